"""Integrations with other libraries (imported on demand: flash_dma.integrations.transformers)."""
