#!/usr/bin/env bash
# Build llama.cpp's tokenizer, and only it, from llama.cpp's own source: its vocabulary code (src/llama-vocab.cpp,
# src/unicode.cpp and the GGUF loader) behind tokenize.cpp, linked against ggml-base. A full `llama-tokenize`
# build compiles every model file and takes most of an hour on 2 busy cores; this takes ~3 minutes.
#
#   tools/checkpoints/llama_cpp_tokenize/build.sh OUT_DIR
#
# The source comes from the llama-cpp-python sdist (vendor/llama.cpp); the fixtures were made with 0.3.36.
set -euo pipefail
out=$(realpath -m "${1:?usage: build.sh OUT_DIR}")
here=$(cd "$(dirname "$0")" && pwd)
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
mkdir -p "$out" && cd "$out"
[ -d "llama_cpp_python-$version" ] || {
    pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d . >/dev/null
    tar xzf "llama_cpp_python-$version.tar.gz"
}
L=$out/llama_cpp_python-$version/vendor/llama.cpp
cmake -S "$L" -B "$L/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_OPENMP=OFF >/dev/null
cmake --build "$L/build" --target ggml-base -j2 >/dev/null
inc="-I$L/include -I$L/src -I$L/ggml/include"
objs=()
for src in "$here/tokenize.cpp" "$here/stubs.cpp" "$L"/src/{llama-vocab,unicode,unicode-data,llama-arch,llama-model-loader,llama-impl,llama-mmap,llama-hparams}.cpp; do
    obj=$(basename "$src" .cpp).o
    g++ -std=c++17 -O1 $inc -c "$src" -o "$obj"
    objs+=("$obj")
done
g++ -o llama-cpp-tokenize "${objs[@]}" -L"$L/build/bin" -lggml-base -Wl,-rpath,"$L/build/bin" -lpthread
echo "$out/llama-cpp-tokenize"
