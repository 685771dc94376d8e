#!/usr/bin/env bash
# Installs the benchmark peers that are not test dependencies: llama-cpp-python, built from its
# PyPI sdist for this CPU (never a prebuilt wheel, so the peer is as fast as llama.cpp can be here).
# CPU only. AMX is switched off: on Sapphire Rapids its extra buffer types crash at load (the
# benchmark does not need them). The multimodal (llava/mtmd) library and the tools are not built:
# the benchmark needs libllama only. The build takes several minutes on 2 idle cores.
# llama.cpp is a benchmark peer only; nothing in src/ imports it.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
if python3 -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.__version__ == '$VERSION' else 1)" 2>/dev/null; then
  echo "llama-cpp-python $VERSION already installed"
else
  export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAVA_BUILD=OFF}"
  export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
  # --no-binary for the peer only: its build tools (scikit-build-core, cmake) may come as wheels.
  # --no-deps + explicit deps so pip can never touch the pinned torch.
  python3 -m pip install --no-cache-dir --no-binary llama-cpp-python --no-deps "llama-cpp-python==$VERSION"
  python3 -m pip install "typing-extensions>=4.5" "diskcache>=5.6.1" "jinja2>=2.11.3" "numpy>=1.20"
  python3 -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'installed')"
fi
# torchao: a side of benchmarks/bench_cpu_kernels.py only (its CPU quantized layouts). --no-deps
# keeps the pinned torch; its CUDA/C++ extensions that do not load here are not needed.
TORCHAO_VERSION="${TORCHAO_VERSION:-0.18.0}"
python3 -m pip install -q --no-deps "torchao==$TORCHAO_VERSION" && echo "torchao $TORCHAO_VERSION installed"
