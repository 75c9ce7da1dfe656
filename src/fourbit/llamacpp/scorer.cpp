// fourbit-score: teacher-forced negative log-likelihood of given token windows, or the
// per-position KL divergence of two models on them.
//
// usage: fourbit-score -m MODEL.gguf -f WINDOWS.txt -t THREADS [--greedy N | --base BASE.gguf]
//            --flash-attn on|off --repack|--no-repack --cache-type-k T --cache-type-v T
// WINDOWS.txt: one window per line, token ids separated by spaces, at least 2 per window.
// Each window is decoded as is (no BOS added) in one batch on an empty KV cache;
// positions 1..W-1 are scored, each from the logits at the position before it.
// stdout: "window <i> tokens <W-1> nll_sum <sum>" per window, then "done <n_windows>".
// With --greedy N, each window is a prompt instead, continued by exactly N tokens, each
// the argmax (lowest id on ties) of the last position's logits, end-of-generation tokens
// included: "greedy <i> ids <id> ... <id>" per window, then "done <n_windows>".
// With --base BASE.gguf, BASE and MODEL (the arm) each decode every window the same way
// and, at each of positions 1..W-1, KL(P_base || P_arm) is computed in double from both
// full log-softmaxes, and whether both argmaxes (lowest id on ties) are the same token:
// "compare <i> positions <W-1> kl <kl> ... top1 <0|1> ..." per window, then "done <n>".
// Errors: a message on stderr naming the problem, exit status 2.
#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

[[noreturn]] static void fail(const std::string & message) {
    fprintf(stderr, "fourbit-score: %s\n", message.c_str());
    exit(2);
}

static ggml_log_level last_level = GGML_LOG_LEVEL_NONE;

static void log_warnings_and_errors(ggml_log_level level, const char * text, void *) {
    if (level != GGML_LOG_LEVEL_CONT) {
        last_level = level;
    }
    if (last_level >= GGML_LOG_LEVEL_WARN) {
        fputs(text, stderr);
    }
}

static ggml_type cache_type(const std::string & name) {
    static const std::map<std::string, ggml_type> types = {
        {"f32", GGML_TYPE_F32}, {"f16", GGML_TYPE_F16}, {"bf16", GGML_TYPE_BF16}, {"q8_0", GGML_TYPE_Q8_0},
    };
    auto found = types.find(name);
    if (found == types.end()) {
        fail("unknown KV cache type '" + name + "'; expected one of f32, f16, bf16, q8_0");
    }
    return found->second;
}

static std::vector<std::vector<llama_token>> read_windows(const std::string & path) {
    std::ifstream in(path);
    if (!in) {
        fail("cannot open windows file " + path);
    }
    std::vector<std::vector<llama_token>> windows;
    std::string line;
    while (std::getline(in, line)) {
        std::istringstream ids(line);
        std::vector<llama_token> window;
        long long id;
        while (ids >> id) {
            window.push_back((llama_token) id);
        }
        if (!ids.eof()) {
            fail("line " + std::to_string(windows.size() + 1) + " of " + path + " holds something other than token ids");
        }
        if (window.size() < 2) {
            fail("window " + std::to_string(windows.size()) + " has " + std::to_string(window.size()) +
                 " tokens; at least 2 are needed (one of context, one scored)");
        }
        windows.push_back(window);
    }
    if (windows.empty()) {
        fail("no windows in " + path);
    }
    return windows;
}

struct Settings {
    int threads;
    bool repack;
    bool flash_attn;
    ggml_type type_k, type_v;
};

// A model and a context that decodes any of the windows (plus greedy tokens) in one ubatch.
struct Loaded {
    llama_model * model = nullptr;
    llama_context * context = nullptr;
    int n_vocab = 0;

    Loaded(const std::string & path, const Settings & settings, size_t longest, int extra_tokens) {
        llama_model_params model_params = llama_model_default_params();
        model_params.n_gpu_layers = 0;
        model_params.use_extra_bufts = settings.repack;
        model = llama_model_load_from_file(path.c_str(), model_params);
        if (model == nullptr) {
            fail("cannot load model " + path);
        }
        n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
        llama_context_params context_params = llama_context_default_params();
        context_params.n_ctx = (uint32_t) (longest + extra_tokens);
        context_params.n_batch = (uint32_t) longest;
        context_params.n_ubatch = (uint32_t) longest;
        context_params.n_seq_max = 1;
        context_params.n_threads = settings.threads;
        context_params.n_threads_batch = settings.threads;
        context_params.flash_attn_type = settings.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
        context_params.type_k = settings.type_k;
        context_params.type_v = settings.type_v;
        context_params.no_perf = true;
        context = llama_init_from_model(model, context_params);
        if (context == nullptr) {
            fail("cannot create a context of " + std::to_string(longest) + " tokens for " + path);
        }
    }

    ~Loaded() {
        llama_free(context);
        llama_model_free(model);
    }

    Loaded(const Loaded &) = delete;
    Loaded & operator=(const Loaded &) = delete;

    // ``window`` into ``batch``, its ids checked, logits asked at positions 0..W-2 (each
    // predicts the next token).
    void fill(llama_batch & batch, const std::vector<llama_token> & window, size_t w) const {
        const int n = (int) window.size();
        for (int j = 0; j < n; j++) {
            if (window[j] < 0 || window[j] >= n_vocab) {
                fail("window " + std::to_string(w) + " position " + std::to_string(j) + ": token id " +
                     std::to_string(window[j]) + " is outside the vocabulary [0, " + std::to_string(n_vocab) + ")");
            }
            batch.token[j] = window[j];
            batch.pos[j] = j;
            batch.n_seq_id[j] = 1;
            batch.seq_id[j][0] = 0;
            batch.logits[j] = j < n - 1;
        }
        batch.n_tokens = n;
    }

    // Decodes ``window`` from an empty KV cache; its logits stay readable until the next decode.
    void decode(llama_batch & batch, const std::vector<llama_token> & window, size_t w) {
        fill(batch, window, w);
        llama_memory_clear(llama_get_memory(context), true);
        if (llama_decode(context, batch) != 0) {
            fail("llama_decode failed on window " + std::to_string(w));
        }
    }
};

// log(sum(exp(logits))) over the vocabulary, in double.
static double log_sum_exp(const float * logits, int n_vocab) {
    double top = logits[0];
    for (int v = 1; v < n_vocab; v++) {
        top = std::max(top, (double) logits[v]);
    }
    double sum = 0.0;
    for (int v = 0; v < n_vocab; v++) {
        sum += std::exp((double) logits[v] - top);
    }
    return top + std::log(sum);
}

static void greedy(Loaded & loaded, llama_batch & batch, const std::vector<llama_token> & prompt, size_t w,
                   int new_tokens) {
    loaded.fill(batch, prompt, w);
    const int n = (int) prompt.size();
    for (int j = 0; j < n; j++) {
        batch.logits[j] = j == n - 1;
    }
    llama_memory_clear(llama_get_memory(loaded.context), true);
    printf("greedy %zu ids", w);
    for (int k = 0; k < new_tokens; k++) {
        if (llama_decode(loaded.context, batch) != 0) {
            fail("llama_decode failed on prompt " + std::to_string(w) + " at token " + std::to_string(k));
        }
        const float * logits = llama_get_logits_ith(loaded.context, -1);
        llama_token next = (llama_token) (std::max_element(logits, logits + loaded.n_vocab) - logits);
        printf(" %d", next);
        batch.token[0] = next;
        batch.pos[0] = n + k;
        batch.n_seq_id[0] = 1;
        batch.seq_id[0][0] = 0;
        batch.logits[0] = 1;
        batch.n_tokens = 1;
    }
    printf("\n");
}

static void score(Loaded & loaded, llama_batch & batch, const std::vector<llama_token> & window, size_t w) {
    loaded.decode(batch, window, w);
    const int n = (int) window.size();
    double nll_sum = 0.0;
    for (int j = 0; j < n - 1; j++) {
        const float * logits = llama_get_logits_ith(loaded.context, j);
        nll_sum += log_sum_exp(logits, loaded.n_vocab) - (double) logits[window[j + 1]];
    }
    printf("window %zu tokens %d nll_sum %.17g\n", w, n - 1, nll_sum);
}

// KL(P_base || P_arm) and top-1 agreement at positions 1..W-1. Each context keeps its own
// logits until its next decode, so the base's are read in place after the arm's decode.
static void compare(Loaded & base, Loaded & arm, llama_batch & batch, const std::vector<llama_token> & window,
                    size_t w) {
    const int n = (int) window.size();
    const size_t n_vocab = (size_t) arm.n_vocab;
    base.decode(batch, window, w);
    arm.decode(batch, window, w);
    std::vector<double> kl(n - 1);
    std::vector<int> top1(n - 1);
    for (int j = 0; j < n - 1; j++) {
        const float * b = llama_get_logits_ith(base.context, j);
        const float * a = llama_get_logits_ith(arm.context, j);
        const double lse_b = log_sum_exp(b, (int) n_vocab);
        const double lse_a = log_sum_exp(a, (int) n_vocab);
        double sum = 0.0;
        for (size_t v = 0; v < n_vocab; v++) {
            const double log_b = (double) b[v] - lse_b;
            sum += std::exp(log_b) * (log_b - ((double) a[v] - lse_a));
        }
        kl[j] = sum;
        top1[j] = std::max_element(b, b + n_vocab) - b == std::max_element(a, a + n_vocab) - a;
    }
    printf("compare %zu positions %d kl", w, n - 1);
    for (double value : kl) {
        printf(" %.17g", value);
    }
    printf(" top1");
    for (int same : top1) {
        printf(" %d", same);
    }
    printf("\n");
}

int main(int argc, char ** argv) {
    std::string model_path, base_path, windows_path, flash_attn, type_k, type_v;
    int threads = 0;
    int repack = -1;
    int greedy_tokens = 0;
    for (int i = 1; i < argc; i++) {
        const std::string arg = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) {
                fail("missing value after " + arg);
            }
            return argv[++i];
        };
        if (arg == "-m") {
            model_path = value();
        } else if (arg == "-f") {
            windows_path = value();
        } else if (arg == "-t") {
            threads = std::atoi(value().c_str());
        } else if (arg == "--flash-attn") {
            flash_attn = value();
        } else if (arg == "--repack") {
            repack = 1;
        } else if (arg == "--greedy") {
            greedy_tokens = std::atoi(value().c_str());
            if (greedy_tokens <= 0) {
                fail("--greedy needs a number of tokens > 0");
            }
        } else if (arg == "--base") {
            base_path = value();
        } else if (arg == "--no-repack") {
            repack = 0;
        } else if (arg == "--cache-type-k") {
            type_k = value();
        } else if (arg == "--cache-type-v") {
            type_v = value();
        } else {
            fail("unknown argument " + arg);
        }
    }
    // Every setting that changes the arithmetic must be given: no silent defaults.
    if (model_path.empty() || windows_path.empty() || threads <= 0 || repack < 0 || type_k.empty() ||
        type_v.empty() || (flash_attn != "on" && flash_attn != "off")) {
        fail("all of -m, -f, -t N>0, --flash-attn on|off, --repack|--no-repack, --cache-type-k, --cache-type-v are required");
    }
    if (greedy_tokens > 0 && !base_path.empty()) {
        fail("--greedy and --base are two different runs; give one");
    }
    const Settings settings = {threads, repack == 1, flash_attn == "on", cache_type(type_k), cache_type(type_v)};
    const auto windows = read_windows(windows_path);
    size_t longest = 0;
    for (const auto & window : windows) {
        longest = std::max(longest, window.size());
    }

    llama_log_set(log_warnings_and_errors, nullptr);
    llama_backend_init();
    {
        Loaded model(model_path, settings, longest, greedy_tokens);
        std::unique_ptr<Loaded> base;
        if (!base_path.empty()) {
            base = std::make_unique<Loaded>(base_path, settings, longest, 0);
            if (base->n_vocab != model.n_vocab) {
                fail("the base model has " + std::to_string(base->n_vocab) + " tokens and " + model_path + " " +
                     std::to_string(model.n_vocab) + "; their distributions cannot be compared");
            }
        }
        llama_batch batch = llama_batch_init((int32_t) longest, 0, 1);
        for (size_t w = 0; w < windows.size(); w++) {
            if (greedy_tokens > 0) {
                greedy(model, batch, windows[w], w, greedy_tokens);
            } else if (base) {
                compare(*base, model, batch, windows[w], w);
            } else {
                score(model, batch, windows[w], w);
            }
            fflush(stdout);
        }
        printf("done %zu\n", windows.size());
        llama_batch_free(batch);
    }
    llama_backend_free();
    return 0;
}
