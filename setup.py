"""ampinit's build.  Metadata lives in pyproject.toml; this file only declares the kernels.

Switches (environment variables):

  AMPINIT_BUILD_EXT=auto|0|1   the compiled extension ``ampinit._C`` (csrc/).  ``auto`` (the
                               default) builds it when torch is importable at build time and
                               falls back to pure Python, with a warning, if the build fails;
                               ``1`` makes a failure an error; ``0`` skips it.
  AMPINIT_BUILD_CUDA=auto|0|1  the CUDA kernels in the same extension.  ``auto`` builds them
                               when torch has CUDA and ``$CUDA_HOME/bin/nvcc`` exists; ``1``
                               requires them.  ``TORCH_CUDA_ARCH_LIST`` picks the GPU archs.
  AMPINIT_BUILD_JOBS=N         source files compiled at once (default: the CPU count; forked
                               workers, Linux only; 1 compiles one after another).

torch must be importable while building, so install with
``pip install --no-build-isolation -e .``; an isolated build has no torch and installs the
pure-Python package.  Whatever was built, ``ampinit.ops.backend()`` says what runs.
"""

import glob
import importlib.util
import multiprocessing
import os
import platform
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]


def _switch(name):
    value = os.environ.get(name, "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        sys.exit(f"{name} must be auto, 0 or 1; got {value!r}")
    return value


def _want_cuda(torch_utils):
    mode = _switch("AMPINIT_BUILD_CUDA")
    import torch

    nvcc = os.path.join(torch_utils.CUDA_HOME or "", "bin", "nvcc")
    possible = torch.version.cuda is not None and torch_utils.CUDA_HOME is not None and os.path.exists(nvcc)
    if mode == "1" and not possible:
        sys.exit(f"AMPINIT_BUILD_CUDA=1, but torch {torch.__version__} has no CUDA or CUDA_HOME "
                 f"({torch_utils.CUDA_HOME}) has no bin/nvcc: install a CUDA torch and set CUDA_HOME")
    return possible and mode != "0"


def _pip_cuda_includes():
    """Headers of the CUDA libraries that pip's CUDA torch brings as ``nvidia-*`` wheels
    (cusparse.h and friends, which ATen's CUDA headers include and a bare nvcc lacks)."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
    return sorted(d for root in roots for d in glob.glob(os.path.join(root, "*", "include")))


# The compile jobs of one compile() call, for the forked workers of _compile_in_parallel.
_JOBS = []


def _run_job(index):
    compile_one, args = _JOBS[index]
    compile_one(*args)


def _compile_in_parallel(compiler, compile_one):
    """``compiler.compile`` running ``compile_one`` for each source in forked workers.

    Not threads: torch's compile wrapper swaps the compiler executable (g++/nvcc) in place
    around each call, which forked processes each do on their own copy.  No ninja either: the
    AVX2 file needs flags of its own, which torch's ninja path cannot give one file.
    """
    jobs = int(os.environ.get("AMPINIT_BUILD_JOBS", "0") or 0) or os.cpu_count() or 1

    def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=0, extra_preargs=None,
                extra_postargs=None, depends=None):
        macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
        _JOBS[:] = [(compile_one, (obj, build[obj][0], build[obj][1], cc_args, extra_postargs, pp_opts))
                    for obj in objects if obj in build]
        if jobs > 1 and len(_JOBS) > 1 and sys.platform.startswith("linux"):
            # Forked processes, not a Pool: a Pool pickles its function by name, and pip's build
            # backend runs this file under a __main__ that the name does not resolve in.
            context = multiprocessing.get_context("fork")
            pending, running, failed = list(range(len(_JOBS))), [], []
            while pending or running:
                while pending and len(running) < jobs:
                    worker = context.Process(target=_run_job, args=(pending.pop(0),))
                    worker.start()
                    running.append(worker)
                running[0].join()
                done = running.pop(0)
                if done.exitcode != 0:
                    failed.append(done.exitcode)
            if failed:
                raise RuntimeError(f"{len(failed)} source file(s) failed to compile (see the compiler output above)")
        else:
            for index in range(len(_JOBS)):
                _run_job(index)
        return objects

    return compile


def get_extensions():
    mode = _switch("AMPINIT_BUILD_EXT")
    if mode == "0":
        return [], {}
    try:
        from torch.utils import cpp_extension
    except ImportError:
        if mode == "1":
            sys.exit("AMPINIT_BUILD_EXT=1 needs torch importable at build time: "
                     "pip install --no-build-isolation -e .")
        return [], {}

    # The linker keeps the first copy of an inline function that several objects define, and
    # distutils links the sources in sorted order: kernels_x86_avx2.cpp sorts after
    # kernels_default.cpp, which defines every such function it does, so the copies kept are
    # the baseline ones.  The AVX2 object's own code runs only behind at::get_cpu_capability().
    sources = ["csrc/module.cpp", "csrc/cpu/ops_cpu.cpp", "csrc/cpu/kernels_default.cpp"]
    macros, include_dirs = [], []
    if platform.machine().lower() in ("x86_64", "amd64"):
        sources.append("csrc/cpu/kernels_x86_avx2.cpp")
        macros.append(("AMPINIT_AVX2_KERNELS", None))
    # -fopenmp: at::parallel_for is inline code around `#pragma omp parallel`; without the flag
    # the pragma is ignored and every CPU kernel runs on one thread.
    compile_args = {"cxx": ["-O3", "-fopenmp", "-Wno-unknown-pragmas"], "nvcc": ["-O3", "-lineinfo"]}
    if _want_cuda(cpp_extension):
        cuda_sources = glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu"))
        sources += sorted(os.path.relpath(path, ROOT) for path in cuda_sources)
        macros.append(("AMPINIT_WITH_CUDA", None))
        include_dirs = _pip_cuda_includes()
        extension = cpp_extension.CUDAExtension
    else:
        extension = cpp_extension.CppExtension
    # The headers, so that editing one rebuilds (build_ext compares only these with the library).
    headers = sorted(os.path.relpath(path, ROOT) for pattern in ("*.h", "*/*.h", "*/*.cuh")
                     for path in glob.glob(os.path.join(ROOT, "csrc", pattern)))
    ext = extension("ampinit._C", sources, depends=headers, define_macros=macros, include_dirs=include_dirs,
                    extra_compile_args=compile_args, extra_link_args=["-fopenmp"])

    class BuildExt(cpp_extension.BuildExtension):
        """Per-file flags for *_avx2.cpp (hence no ninja), sources compiled in parallel, and
        ``auto``'s soft failure."""

        def build_extension(self, extension_):
            compile_one = self.compiler._compile

            def compile_with_file_flags(obj, src, ext_, cc_args, extra_postargs, pp_opts):
                if src.endswith("_avx2.cpp"):
                    if isinstance(extra_postargs, dict):
                        extra_postargs = dict(extra_postargs, cxx=list(extra_postargs["cxx"]) + AVX2_FLAGS)
                    else:
                        extra_postargs = list(extra_postargs) + AVX2_FLAGS
                compile_one(obj, src, ext_, cc_args, extra_postargs, pp_opts)

            self.compiler._compile = compile_with_file_flags
            serial_compile = self.compiler.compile
            self.compiler.compile = _compile_in_parallel(self.compiler, compile_with_file_flags)
            try:
                super().build_extension(extension_)
            except Exception as error:  # noqa: BLE001 - auto mode installs pure Python instead
                if mode == "1":
                    raise
                self.warn(f"ampinit: building the compiled kernels failed ({error}); installing the "
                          "pure-PyTorch fallback.  Set AMPINIT_BUILD_EXT=1 to see this as an error.")
            finally:
                self.compiler._compile = compile_one
                self.compiler.compile = serial_compile

    return [ext], {"build_ext": BuildExt.with_options(use_ninja=False)}


ext_modules, cmdclass = get_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
