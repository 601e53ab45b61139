"""Build LMCache's ``cuda_ops`` extension from its source distribution against the torch installed here.

LMCache 0.5.6's wheel ships ``lmcache.cuda_ops`` compiled for another torch; against torch 2.11 it
does not load (undefined C++ symbols) and LMCache falls back to torch copies. This compiles the
same sources (``setup_extensions/build_profiles/cuda.py`` in the sdist) with torch's extension
builder and ninja, for one GPU architecture, and writes the module next to the installed package:

    python -m benchmarks.build_lmcache_cuda_ops --sdist .sdist/lmcache-0.5.6.tar.gz --site /tmp/site --arch 9.0

kvoffload's own copies do not use ``cuda_ops``; this exists to measure LMCache's copies both ways.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import sysconfig
import tarfile
import tempfile
import time
from pathlib import Path

CUDA_SOURCES = (
    "pybind.cpp",
    "mem_kernels.cu",
    "mp_mem_kernels.cu",
    "phase_timing_recorder.cu",
    "blend_kernels.cu",
    "cal_cdf.cu",
    "ac_enc.cu",
    "ac_dec.cu",
    "pos_kernels.cu",
    "mem_alloc.cpp",
    "utils.cpp",
    "event_recorder.cpp",
    "completion_recorder.cpp",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist", required=True)
    parser.add_argument("--site", required=True, help="directory holding the installed lmcache package")
    parser.add_argument("--arch", default="9.0", help="TORCH_CUDA_ARCH_LIST")
    parser.add_argument("--jobs", default=str(os.cpu_count() or 4))
    args = parser.parse_args(argv)
    os.environ["TORCH_CUDA_ARCH_LIST"] = args.arch
    os.environ["MAX_JOBS"] = args.jobs
    work = Path(tempfile.mkdtemp(prefix="lmcache-sdist-"))
    with tarfile.open(args.sdist) as tar:
        tar.extractall(work, filter="data")
    root = next(work.iterdir())
    csrc = root / "csrc"
    from torch.utils import cpp_extension

    t0 = time.monotonic()
    build_dir = work / "build"
    build_dir.mkdir()
    module_path = cpp_extension.load(
        name="cuda_ops",
        sources=[str(csrc / "cuda" / s) for s in CUDA_SOURCES],
        extra_include_paths=[str(csrc)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3"],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    del module_path
    built = build_dir / "cuda_ops.so"
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    target = Path(args.site) / "lmcache" / f"cuda_ops{suffix}"
    shutil.copy2(built, target)
    print(f"built {target} in {time.monotonic() - t0:.0f} s from {Path(args.sdist).name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
