# Sourced: finishes the CuTe DSL install (second half of the big wheel, carried in .cute/b) the
# first time on a machine, then exports the paths. See README.md.
if [ ! -d /tmp/site/nvidia_cutlass_dsl ]; then
  if [ -f /tmp/cute/cu13.part.aa ] && [ -f .cute/b/cu13.part.ab ]; then
    cat /tmp/cute/cu13.part.aa .cute/b/cu13.part.ab > "/tmp/cute/$(cat /tmp/cute/BIG_WHEEL_NAME)" \
      && rm /tmp/cute/cu13.part.aa \
      && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site /tmp/cute/*.whl
  else
    echo "env.sh: the CuTe DSL stack is not on this machine (run stack1.sh first, then carry .cute/b)" >&2
  fi
fi
export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/.peers/site:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
