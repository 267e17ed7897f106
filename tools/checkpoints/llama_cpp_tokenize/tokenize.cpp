// llama.cpp's own vocabulary code (src/llama-vocab.cpp, unicode.cpp) on a GGUF file's tokenizer metadata: prints
// llama_tokenize(text, add_special=true, parse_special=true), what llama-server does with a prompt, for the text
// in the file argv[2] (read verbatim). Built by build.sh beside it.
#include "llama-model-loader.h"
#include "llama-vocab.h"
#include "llama-arch.h"
#include "gguf.h"
#include <cstdio>
#include <fstream>
#include <sstream>

int main(int argc, char ** argv) {
    if (argc < 3) { fprintf(stderr, "usage: %s model.gguf text-file\n", argv[0]); return 1; }
    std::vector<std::string> splits;
    gguf_init_params p = { /*no_alloc*/ true, /*ctx*/ nullptr };
    gguf_context * meta = gguf_init_from_file(argv[1], p);
    if (!meta) { fprintf(stderr, "cannot read %s\n", argv[1]); return 1; }
    std::string arch_name = gguf_get_val_str(meta, gguf_find_key(meta, "general.architecture"));
    llama_vocab vocab;
    {
        llama_model_loader ml(nullptr, nullptr, nullptr, argv[1], splits, nullptr, LLAMA_LOAD_MODE_NONE,
                              false, true, false, nullptr, nullptr);
        vocab.load(ml, LLM_KV(llm_arch_from_string(arch_name)));
    }
    std::ifstream in(argv[2], std::ios::binary);
    std::stringstream ss; ss << in.rdbuf();
    std::vector<llama_token> ids = vocab.tokenize(ss.str(), true, true);
    printf("[");
    for (size_t i = 0; i < ids.size(); i++) printf(i ? ", %d" : "%d", ids[i]);
    printf("]\n");
    return 0;
}
