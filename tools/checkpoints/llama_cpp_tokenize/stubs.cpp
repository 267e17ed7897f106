// The loader's few references outside the vocabulary path (single-file GGUFs, no backends are used).
#include "llama.h"
#include "ggml-backend.h"
extern "C" ggml_backend_dev_t ggml_backend_dev_by_type(enum ggml_backend_dev_type) { return nullptr; }
int32_t llama_split_path(char *, size_t, const char *, int32_t, int32_t) { return 0; }
int32_t llama_split_prefix(char *, size_t, const char *, int32_t, int32_t) { return 0; }
