// The non-GEMM parts of the population LSTM forward: the fused gate/cell update and the
// log-softmax + NLL of the output logits. The GEMMs (embed @ w_ih, h @ w_hh, hs @ w_ih, hs @ out.w)
// run in cuBLAS through CuPy; zosoma/engines/cuda/cuda_forward.py drives the time loop. Mirrors
// zosoma/engines/cpu/forward.py (`lstm_cell_rows`, `output_rows`) and zosoma/model/reference.py (the
// ground truth).
//
// Shapes: M population members, B batch, T time (Tc: the timesteps of one chunk), E embedding,
// H hidden, G = 4H gate columns (blocks i, f, g, o), V = 256. Every member has its own weights,
// so every array carries a leading M axis.
//
// Launch (zosoma/engines/cuda/custom_kernels.py): 1-D, block = (256, 1, 1), grid.x = min(ceil(work / 256), cap), with
// grid-stride loops over 64-bit indices. One thread per (member, row, hidden unit) in the cell
// kernels; one thread per (member, time, row) in log_softmax_nll: a row of V = 256 logits is small,
// and keeping each row in one thread needs no shared memory or barriers, so tests/test_kernels.py
// runs these kernels on the CPU through emulate.h.

#define VOCAB 256  // V: one logit per byte value (zosoma.config.VOCAB)

__device__ __forceinline__ float sigmoid(float x) {
    return 1.0f / (1.0f + expf(-x));
}

// One unit j of one row: gate pre-activations = gates + x + bias (x @ w_ih + h @ w_hh + b), then
// i, f, o = sigmoid, g = tanh, c' = f*c + i*g, h' = o*tanh(c'). c is read and rewritten in place.
__device__ __forceinline__ float cell_unit(const float* gates, const float* x, const float* bias,
                                           int H, int j, float* c) {
    const float i = sigmoid(gates[j] + x[j] + bias[j]);
    const float f = sigmoid(gates[H + j] + x[H + j] + bias[H + j]);
    const float g = tanhf(gates[2 * H + j] + x[2 * H + j] + bias[2 * H + j]);
    const float o = sigmoid(gates[3 * H + j] + x[3 * H + j] + bias[3 * H + j]);
    const float cn = f * (*c) + i * g;
    *c = cn;
    return o * tanhf(cn);
}

// Layer 0, step t of a chunk: the input projection of byte v is row v of table = embed @ w_ih
// (exact: x_t @ w_ih with x_t = embed[v]), as zosoma.engines.cpu.forward does.
//   gates  (M, B, G)   h_prev @ w_hh
//   table  (M, V, G)   embed @ w_ih
//   tokens            byte of (m, b) at absolute time tt: tokens[m*tok_sm + b*tok_sb + tt]
//                     (tok_sm = 0 when all members share one batch)
//   bias   (M, G);  c, h (M, B, H): c updated in place, h written;  hs (M, Tc, B, H): h at step t
extern "C" __global__ void lstm_cell_embed(const float* gates, const float* table,
                                           const unsigned char* tokens, long long tok_sm,
                                           long long tok_sb, int tt, const float* bias, float* c,
                                           float* h, float* hs, int M, int B, int H, int Tc, int t) {
    const long long G = 4LL * H;
    const long long total = (long long)M * B * H;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        const int j = (int)(idx % H);
        const long long mb = idx / H;  // m * B + b
        const int b = (int)(mb % B);
        const long long m = mb / B;
        const unsigned int v = tokens[m * tok_sm + b * tok_sb + tt];
        const float hn = cell_unit(gates + mb * G, table + (m * VOCAB + v) * G, bias + m * G, H, j, c + idx);
        h[idx] = hn;
        hs[((m * Tc + t) * B + b) * H + j] = hn;
    }
}

// Layers >= 1, step t of a chunk: the input projection of all Tc steps was one GEMM.
//   xproj (M, Tc, B, G)  hs_below @ w_ih;  the other arguments as lstm_cell_embed
extern "C" __global__ void lstm_cell_proj(const float* gates, const float* xproj, const float* bias,
                                          float* c, float* h, float* hs, int M, int B, int H, int Tc,
                                          int t) {
    const long long G = 4LL * H;
    const long long total = (long long)M * B * H;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        const int j = (int)(idx % H);
        const long long mb = idx / H;
        const int b = (int)(mb % B);
        const long long m = mb / B;
        const float hn = cell_unit(gates + mb * G, xproj + ((m * Tc + t) * B + b) * G, bias + m * G, H, j, c + idx);
        h[idx] = hn;
        hs[((m * Tc + t) * B + b) * H + j] = hn;
    }
}

// Log-softmax + NLL of one chunk of Tc timesteps starting at absolute time t0. CPU:
// zosoma.engines.cpu.forward.output_rows; reference: zosoma.model.reference.nll.
//   logits  (M, Tc, B, V)  hs @ out.w, out.b not yet added
//   bias    (M, V)         out.b
//   targets               target byte of (m, b, t0 + t) at targets[m*tgt_sm + b*tgt_sb + t0 + t]
//   nll     (M, B, T)      written at [m, b, t0 + t]
//   logp    (M, B, T, V)   log-probabilities, written only when want_logp
// Two passes over the row as the CPU does: the max, then sum exp(z - max); nll = max + log(sum) - z.
extern "C" __global__ void log_softmax_nll(const float* logits, const float* bias,
                                           const unsigned char* targets, long long tgt_sm,
                                           long long tgt_sb, float* nll, float* logp, int want_logp,
                                           int M, int B, int T, int t0, int Tc) {
    const long long rows = (long long)M * Tc * B;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += stride) {
        const int b = (int)(r % B);
        const int t = (int)((r / B) % Tc);
        const long long m = r / ((long long)B * Tc);
        const float* z = logits + r * VOCAB;
        const float* zb = bias + m * VOCAB;
        float mx = z[0] + zb[0];
        for (int v = 1; v < VOCAB; ++v) mx = fmaxf(mx, z[v] + zb[v]);
        float s = 0.0f;
        for (int v = 0; v < VOCAB; ++v) s += expf((z[v] + zb[v]) - mx);
        const float lse = mx + logf(s);
        const unsigned int y = targets[m * tgt_sm + b * tgt_sb + t0 + t];
        const long long o = (m * B + b) * T + t0 + t;  // [m, b, t0 + t]
        nll[o] = lse - (z[y] + zb[y]);
        if (want_logp) {
            float* out = logp + o * VOCAB;
            for (int v = 0; v < VOCAB; ++v) out[v] = (z[v] + zb[v]) - lse;
        }
    }
}
