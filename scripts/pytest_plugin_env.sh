# Register memcallbacks' pytest plugin the one way that works in this environment. Source it, then call
# the function before running pytest (scripts/gpu_check.sh does):
#   . scripts/pytest_plugin_env.sh && memcallbacks_pytest_plugin_env && python3 -m pytest ...
# Where memcallbacks is pip-installed, pytest loads the plugin through its pytest11 entry point and
# this does nothing. From a plain checkout (memcallbacks importable through PYTHONPATH, no entry
# point), or with PYTEST_DISABLE_PLUGIN_AUTOLOAD set (pytest loads no entry point then), it appends
# memcallbacks.pytest_plugin to PYTEST_PLUGINS. Never both: pluggy refuses to register one module
# under two names ("Plugin already registered under a different name").
memcallbacks_pytest_plugin_env() {
  case ",${PYTEST_PLUGINS:-}," in
    *,memcallbacks.pytest_plugin,*) return 0 ;;  # already there
  esac
  if [ -z "${PYTEST_DISABLE_PLUGIN_AUTOLOAD:-}" ] && python3 - <<'PY'
import sys
from importlib.metadata import entry_points

# what pytest itself loads: the pytest11 entry points of the distributions on sys.path
found = any(ep.value.split(":")[0].strip() == "memcallbacks.pytest_plugin" for ep in entry_points(group="pytest11"))
sys.exit(0 if found else 1)
PY
  then
    return 0
  fi
  export PYTEST_PLUGINS="${PYTEST_PLUGINS:+$PYTEST_PLUGINS,}memcallbacks.pytest_plugin"
}
