/* llama.cpp's decode step at a given depth, KV on the GPU and KV in host RAM, for issue 5's peer rows.

   Why a program of our own rather than llama-bench: llama-bench reaches its depth by prefilling it, and with the KV
   in host RAM (offload_kqv = false) that prefill's attention runs on the CPU, tens of minutes at 64K on the 8B shape.
   Here the depth is prefilled with the KV on the GPU, the sequence's state is copied out (llama_state_seq_get_data)
   and a context with the KV in host RAM takes it in (llama_state_seq_set_data), so only decode steps run on the CPU.
   The state moves only between contexts of one attention kind (flash attention stores V untransposed, the plain
   path transposed), hence two GPU prefills.

   Usage: peer_step MODEL DEPTH STEPS THREADS
   Prints one JSON object on stdout: per-step milliseconds of each configuration (after two untimed steps), batch 1,
   weights on the GPU in all three (n_gpu_layers = all):
     kv_gpu_fa_ms    offload_kqv = true, flash attention on
     kv_gpu_ms       offload_kqv = true, flash attention off (llama-cpp-python's default)
     kv_host_ms      offload_kqv = false, flash attention off: attention on the CPU with THREADS threads, as
                     llama-cpp-python's Llama(offload_kqv=False) runs it; its cache is the kv_gpu context's */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "llama.h"

#define WARMUP_STEPS 2
#define PREFILL_CHUNK 2048
#define HOST_UBATCH 512 /* the host context's compute buffer holds KQ for n_ctx x ubatch: keep it a few GB */

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static struct llama_context *new_context(struct llama_model *model, int n_ctx, int threads, int kv_on_gpu,
                                         int flash) {
    struct llama_context_params p = llama_context_default_params();
    p.n_ctx = (uint32_t)n_ctx;
    p.n_batch = PREFILL_CHUNK;
    p.n_ubatch = kv_on_gpu ? PREFILL_CHUNK : HOST_UBATCH;
    p.n_seq_max = 1;
    p.n_threads = threads;
    p.n_threads_batch = threads;
    p.offload_kqv = kv_on_gpu != 0;
    p.flash_attn_type = flash ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    p.no_perf = 1;
    return llama_init_from_model(model, p);
}

/* DEPTH random tokens into a fresh GPU-KV context, PREFILL_CHUNK at a time; returns the seconds it took, -1 on error */
static double prefill(struct llama_context *ctx, llama_token *chunk, int depth, int n_vocab) {
    double t0 = now_ms();
    for (int done = 0; done < depth; done += PREFILL_CHUNK) {
        int n = depth - done < PREFILL_CHUNK ? depth - done : PREFILL_CHUNK;
        for (int i = 0; i < n; i++) chunk[i] = (llama_token)(rand() % n_vocab);
        if (llama_decode(ctx, llama_batch_get_one(chunk, n)) != 0) {
            fprintf(stderr, "prefill failed at %d\n", done);
            return -1;
        }
    }
    llama_synchronize(ctx);
    return (now_ms() - t0) / 1e3;
}

/* One token per step at the sequence's next position; fills ms[0..steps) with each step's wall time. */
static int time_steps(struct llama_context *ctx, int n_vocab, int steps, double *ms) {
    for (int i = -WARMUP_STEPS; i < steps; i++) {
        llama_token tok = (llama_token)(rand() % n_vocab);
        double t0 = now_ms();
        if (llama_decode(ctx, llama_batch_get_one(&tok, 1)) != 0) return 1;
        llama_synchronize(ctx);
        if (i >= 0) ms[i] = now_ms() - t0;
    }
    return 0;
}

static void print_row(const char *name, const double *ms, int steps, int last) {
    printf("\"%s\": [", name);
    for (int i = 0; i < steps; i++) printf("%s%.4f", i ? ", " : "", ms[i]);
    printf("]%s", last ? "" : ", ");
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s MODEL DEPTH STEPS THREADS\n", argv[0]);
        return 2;
    }
    const char *path = argv[1];
    int depth = atoi(argv[2]), steps = atoi(argv[3]), threads = atoi(argv[4]);
    if (depth < 1 || steps < 1 || threads < 1) {
        fprintf(stderr, "DEPTH, STEPS and THREADS must be positive integers\n");
        return 2;
    }
    srand(1234);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = -1;
    mp.use_extra_bufts = 0; /* the AMX repack path segfaults on some hosts; the weights sit on the GPU anyway */
    struct llama_model *model = llama_model_load_from_file(path, mp);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", path);
        return 1;
    }
    int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    int n_ctx = depth + WARMUP_STEPS + steps + 16;
    double *fa_ms = calloc((size_t)steps, sizeof(double)), *gpu_ms = calloc((size_t)steps, sizeof(double));
    double *host_ms = calloc((size_t)steps, sizeof(double));
    llama_token *chunk = malloc(sizeof(llama_token) * PREFILL_CHUNK);

    struct llama_context *fa = new_context(model, n_ctx, threads, 1, 1);
    double fa_prefill_s = fa ? prefill(fa, chunk, depth, n_vocab) : -1;
    if (fa_prefill_s < 0 || time_steps(fa, n_vocab, steps, fa_ms) != 0) return 1;
    llama_free(fa);

    struct llama_context *gpu = new_context(model, n_ctx, threads, 1, 0);
    double prefill_s = gpu ? prefill(gpu, chunk, depth, n_vocab) : -1;
    if (prefill_s < 0) return 1;
    size_t state_size = llama_state_seq_get_size(gpu, 0);
    uint8_t *state = malloc(state_size);
    if (!state || llama_state_seq_get_data(gpu, state, state_size, 0) != state_size) {
        fprintf(stderr, "cannot copy the sequence state (%zu bytes)\n", state_size);
        return 1;
    }
    if (time_steps(gpu, n_vocab, steps, gpu_ms) != 0) return 1;
    llama_free(gpu);

    struct llama_context *host = new_context(model, n_ctx, threads, 0, 0);
    if (!host || llama_state_seq_set_data(host, state, state_size, 0) == 0) {
        fprintf(stderr, "cannot load the sequence state into the host-KV context\n");
        return 1;
    }
    free(state);
    if (time_steps(host, n_vocab, steps, host_ms) != 0) return 1;
    llama_free(host);

    printf("{\"depth\": %d, \"threads\": %d, \"prefill_fa_s\": %.3f, \"prefill_s\": %.3f, \"state_bytes\": %zu, ",
           depth, threads, fa_prefill_s, prefill_s, state_size);
    print_row("kv_gpu_fa_ms", fa_ms, steps, 0);
    print_row("kv_gpu_ms", gpu_ms, steps, 0);
    print_row("kv_host_ms", host_ms, steps, 1);
    printf("}\n");
    free(fa_ms);
    free(gpu_ms);
    free(host_ms);
    free(chunk);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
