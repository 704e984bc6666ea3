#!/usr/bin/env bash
# Kernel tests on CUDA in bfloat16, then the kernel microbenchmark. Logs and JSON go to $OUT.
# Run from the repository root: bash bench/gpu_kernel_tests.sh
set -u
OUT=${OUT:-bench/results/local}
mkdir -p "$OUT"
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"

# The kernels need only torch and triton, but importing the drafter registry pulls in model
# loading (safetensors, tqdm). Where those are absent, stand-ins that fail only when used
# keep the imports working.
STUBS=$(mktemp -d)
cat > "$STUBS/sitecustomize.py" <<'PY'
import importlib.abc
import importlib.machinery
import sys
import types

_OPTIONAL = {"safetensors", "tqdm", "transformers", "gguf", "scipy"}


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        raise ImportError(f"{self.__name__} is not installed on this machine")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _OPTIONAL:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Stub(spec.name)

    def exec_module(self, module):
        module.__path__ = []


sys.meta_path.append(_Finder())  # consulted only after the real finders fail
PY
export PYTHONPATH="$PYTHONPATH:$STUBS"

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import safetensors, tqdm; print('optional modules: real')" 2>/dev/null \
    || echo "optional modules: stubbed"
} 2>&1 | tee "$OUT/env.txt"

SPECDEC_TEST_DEVICE=cuda timeout 240 python3 -m pytest --noconftest -p no:cacheprovider \
  tests/test_kernels.py -q -rf 2>&1 | tee "$OUT/kernel_tests.log"
tests_rc=${PIPESTATUS[0]}

timeout 150 python3 bench/kernels_gpu.py --out "$OUT/kernels_bench.json" 2>&1 \
  | tee "$OUT/kernels_bench.log"
bench_rc=${PIPESTATUS[0]}

echo "tests rc=$tests_rc bench rc=$bench_rc" | tee -a "$OUT/env.txt"
rm -rf "$STUBS"
exit $(( tests_rc != 0 || bench_rc != 0 ))
