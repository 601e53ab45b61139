"""An environment shaped like a TensorRT-LLM image, and the connector bundle built for it.

``hack/setup.sh`` creates the environment (``$KVOFFLOAD_CACHE/trtllm-image``: Python 3.12 and
exactly ``hack/trtllm-image/requirements.txt``, no lmcache, no kvoffload). The bundle is built by
``hack/build_bundle.py``, the recipe the Dockerfile's bundle-build stage runs. The end-to-end
test, the demo and the bundle test run their TensorRT-LLM stand-in with this interpreter and the
bundle on PYTHONPATH, as the operator injects it, so nothing of the development venv is visible.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from hack.localcluster import CACHE_DIR

HACK = Path(__file__).resolve().parent
REPO_ROOT = HACK.parent
IMAGE_ENV = CACHE_DIR / "trtllm-image"
REQUIREMENTS = HACK / "trtllm-image" / "requirements.txt"

ENGINE_LAUNCHER = (
    "import sys; sys.path.append(sys.argv.pop(1)); "
    "from tests.support.trtllm_executor import main; sys.exit(main(sys.argv[1:]))"
)
"""``python -c`` code that starts the TensorRT-LLM stand-in in the image environment. The checkout is
appended to the END of ``sys.path`` (after the image's site-packages), only so that the stand-in's own
code is found: kvoffload and lmcache come from the bundle on PYTHONPATH, their deps from the image
or the bundle's ``deps/``. The checkout holds no third-party package that could fill a gap."""


class ImageEnvError(RuntimeError):
    """The image-shaped environment is missing; the message says how to make it."""


def image_python() -> Path:
    """The image environment's interpreter."""
    python = IMAGE_ENV / "bin" / "python"
    if not python.exists():
        raise ImageEnvError(f"{python} is missing: run hack/setup.sh python (it creates the TensorRT-LLM-image env)")
    return python


def engine_argv(*args: str) -> list[str]:
    """argv that runs ``tests.support.trtllm_executor`` in the image environment."""
    return [str(image_python()), "-c", ENGINE_LAUNCHER, str(REPO_ROOT), *args]


def build_bundle(out: Path) -> Path:
    """The connector bundle of this checkout, built for the image's Python as the Dockerfile builds it."""
    argv = [str(image_python()), str(HACK / "build_bundle.py"), "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise ImageEnvError(f"building the connector bundle failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return out
