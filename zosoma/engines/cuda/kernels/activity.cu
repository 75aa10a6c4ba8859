// Activity (node) perturbation on the device: the noise on the pre-activations of 2K members x B
// rows that share one theta, and the combination of the pairs' noise for the update. The GEMMs and
// the cell and softmax kernels are the population forward's (lstm.cu + cuBLAS);
// zosoma/engines/cuda/activity_forward.py drives them. Mirrors zosoma/engines/cpu/noisy_forward.py
// (`_add_noise`, `_weighted_noise`) and zosoma/model/node_perturbation.py (the reference).
//
// Shapes: M members, B batch, R = M*B rows (row r = m*B + b: member m's copy of batch row b),
// T time, J drawn noises, S the pre-activations of one position that take noise (L*4H gates, then
// the V logits when the readout is perturbed). Z (J, B, T, S): noise j of batch row b at time t.
// Launch (custom_kernels.launch): 1-D grid-stride loops, one thread per element written.

#include "lstm.cu"  // cell_unit: the gate and cell math of the population forward

// One step t of one layer of the R rows (one theta): each row's gates (R, G) = h_prev @ w_hh plus
// its member's noise sign[m] * scale * Z[index[m], b, t, lo:lo + G], then lstm_cell_embed's or
// lstm_cell_proj's cell (embed = 1: the input projection is row `byte` of table (V, G), byte =
// tokens[r * tok_sb + t]; embed = 0: xproj (T, R, G)). One thread per (row, unit j) owns the four
// gate entries of its unit, so the noise and the cell are one launch with add_activity_noise's
// and the cell kernel's arithmetic (the same bits). c, h (R, H); hs (T, R, H).
extern "C" __global__ void noisy_cell(float* gates, const float* table, const float* xproj,
                                      const unsigned char* tokens, long long tok_sb, int embed, const float* bias,
                                      float* c, float* h, float* hs, int R, int H, int t, const float* Z,
                                      const int* index, const float* sign, float scale, int B, int T, int S,
                                      int lo) {
    const long long G = 4LL * H;
    const long long total = (long long)R * H;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        const int j = (int)(idx % H);
        const long long r = idx / H;
        const int m = (int)(r / B), b = (int)(r % B);
        const float k = __fmul_rn(sign[m], scale);
        const float* z = Z + (((long long)index[m] * B + b) * T + t) * S + lo;
        float* g = gates + r * G;
        for (int q = 0; q < 4; ++q) g[q * H + j] = __fadd_rn(g[q * H + j], __fmul_rn(k, z[q * H + j]));
        const float* x = embed ? table + (long long)tokens[r * tok_sb + t] * G : xproj + ((long long)t * R + r) * G;
        const float hn = cell_unit(g, x, bias, H, j, c + idx);
        h[idx] = hn;
        hs[((long long)t * R + r) * H + j] = hn;
    }
}

// rows (steps, R, width): rows[s, r, :] += (sign[m] * scale) * Z[index[m], b, t + s, lo:lo + width]
// for r = m*B + b: member m's noise as the member table says (index into Z, sign +1 or -1), on a
// chunk of the logits' time steps. The product is rounded before the sum, as the CPU's loop does.
extern "C" __global__ void add_activity_noise(float* rows, const float* Z, const int* index, const float* sign,
                                              float scale, int R, int B, int T, int S, int t, int steps, int lo,
                                              int width) {
    const long long total = (long long)steps * R * width;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int j = (int)(i % width);
        const long long sr = i / width;
        const int r = (int)(sr % R);
        const int s = (int)(sr / R);
        const int m = r / B, b = r % B;
        const float k = __fmul_rn(sign[m], scale);
        const float z = Z[(((long long)index[m] * B + b) * T + t + s) * S + lo + j];
        rows[i] = __fadd_rn(rows[i], __fmul_rn(k, z));
    }
}

// zeta (B, T, S) = sum_k w[k, b, t] * Z[k, b, t, :], the gates' weights w_gates on the first
// `gates` of S, the logits' w_logits on the rest (K, B, T float64 each); summed over k in order in
// float64 and rounded once, as the CPU's loop does: the update's combination of the pairs' noise
// (zosoma.model.node_perturbation.combined, .credit).
extern "C" __global__ void weighted_noise(float* zeta, const double* w_gates, const double* w_logits, const float* Z,
                                          int K, long long BT, int S, int gates) {
    const long long total = BT * S;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int j = (int)(i % S);
        const long long bt = i / S;
        const double* w = j < gates ? w_gates : w_logits;
        double acc = 0.0;
        for (int k = 0; k < K; ++k)
            acc = __dadd_rn(acc, __dmul_rn(w[k * BT + bt], (double)Z[(k * BT + bt) * S + j]));
        zeta[i] = (float)acc;
    }
}
