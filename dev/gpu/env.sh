# Sourced: finishes the installs whose second halves this call carries (.cute/b, .qla/b; once per
# machine), then exports the paths. See README.md.
if [ ! -d /tmp/site/nvidia_cutlass_dsl ] && [ -f /tmp/cute/cu13.part.aa ] && [ -f .cute/b/cu13.part.ab ]; then
  cat /tmp/cute/cu13.part.aa .cute/b/cu13.part.ab > "/tmp/cute/$(cat /tmp/cute/BIG_WHEEL_NAME)" \
    && rm /tmp/cute/cu13.part.aa \
    && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site /tmp/cute/*.whl
fi
if [ ! -d /tmp/site/flash_qla ] && [ -d /tmp/qla ] && [ -d .qla/b ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/qla/*.whl .qla/b/*.whl
fi
[ -d /tmp/site/nvidia_cutlass_dsl ] || echo "env.sh: no CuTe DSL stack on this machine (stack1.sh with .cute/a, then carry .cute/b)" >&2
export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/.peers/site:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
