// fourbit-imatrix: llama-imatrix reading token ids instead of text.
//
// fourbit.llamacpp.recipe compiles llama.cpp's own tools/imatrix/imatrix.cpp a second time
// with this function inserted before compute_imatrix and its one call to common_tokenize
// replaced by a call to it. The prompt file (-f) then holds token ids: one chunk per line,
// ids separated by spaces, every line as long as -c. llama-imatrix writes the vocabulary's
// BOS over each chunk's first token when the vocabulary adds one, so such a line starts
// with BOS and the ids after it are the window. Everything else is llama-imatrix's: the
// chunking, the activations it collects, the statistics and the GGUF it writes.
#include <sstream>

static std::vector<llama_token> fourbit_token_ids(const llama_context * ctx, const std::string & text) {
    const llama_vocab * vocab = llama_model_get_vocab(llama_get_model(ctx));
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);
    const bool add_bos = llama_vocab_get_add_bos(vocab);
    auto fail = [](const std::string & message) {
        fprintf(stderr, "fourbit-imatrix: %s\n", message.c_str());
        exit(1);
    };
    std::vector<llama_token> ids;
    std::istringstream lines(text);
    std::string line;
    size_t width = 0;
    size_t n_lines = 0;
    while (std::getline(lines, line)) {
        std::istringstream fields(line);
        std::vector<llama_token> chunk;
        long long id = 0;
        while (fields >> id) {
            if (id < 0 || id >= n_vocab) {
                fail("line " + std::to_string(n_lines + 1) + ": token id " + std::to_string(id) +
                     " is outside the vocabulary of " + std::to_string(n_vocab));
            }
            chunk.push_back((llama_token) id);
        }
        if (!fields.eof() || chunk.empty()) {
            fail("line " + std::to_string(n_lines + 1) + " is not a list of token ids");
        }
        if (n_lines > 0 && chunk.size() != width) {
            fail("line " + std::to_string(n_lines + 1) + " has " + std::to_string(chunk.size()) +
                 " ids, the first line " + std::to_string(width) + ": every chunk is -c ids long");
        }
        if (add_bos && chunk[0] != llama_vocab_bos(vocab)) {
            fail("line " + std::to_string(n_lines + 1) + " starts with id " + std::to_string(chunk[0]) +
                 ": this vocabulary adds BOS (id " + std::to_string(llama_vocab_bos(vocab)) +
                 "), which llama-imatrix writes over each chunk's first id; start each line with it");
        }
        width = chunk.size();
        ids.insert(ids.end(), chunk.begin(), chunk.end());
        n_lines++;
    }
    fprintf(stderr, "fourbit-imatrix: read %zu chunks of %zu token ids (add_bos %d)\n", n_lines, width,
            (int) add_bos);
    return ids;
}
