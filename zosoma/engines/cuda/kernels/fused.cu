// The small-expert population forward in ONE launch: one block per member builds the member's
// weights theta + sign * eps * delta_direction from the Philox counters into shared memory, runs
// the T-step LSTM recurrence of its B rows, the logits and the log-softmax NLL, and writes the
// member's mean loss. No GEMM, no intermediate array in global memory, no per-timestep launch
// (docs/gpu.md, "Small experts: launches, not FLOPs"). CPU: zosoma.engines.cpu.forward
// population_loss of the perturbed members; reference: zosoma.model.reference.loss.
//
// Shapes: M members, N experts (each its own theta and counters), B batch, T time, E embedding,
// H hidden, G = 4H gate columns (blocks i, f, g, o), L layers, V = 256, d parameters.
//
// The member table (one entry per member m, so the members of N experts can share a launch):
//   direction (M,) int32    the noise direction (the perturb kernel's `member` counter)
//   sign      (M,) float32  +1, -1 (antithetic pair) or 0 (theta itself, no noise)
//   expert    (M,) int32    row of thetas, counters and eps
//   batch     (M,) int32    which (B, T+1) batch of `batches` the member reads
// Per expert n: thetas (N, d); counters (N, 4) uint32 = (k0, k1, expert id, step) of
// zosoma.model.noise's Philox key and counter; eps (N,) float32.
//
// A member's weights are rounded as the perturb kernel rounds them (theta + (sign*eps)*delta, the
// product and the sum rounded separately), so they are bit-identical to the perturbed population
// the unfused path builds; the forward sums in another order than cuBLAS or Numba, so losses
// agree with those within float32 rounding (tests/test_kernels.py states the tolerance).
//
// Launch (zosoma/engines/cuda/fused_forward.py): grid.x over members (a block-stride loop), any
// number of threads per block (thread-stride loops), dynamic shared memory of fused_floats()
// floats plus B doubles. Every barrier is reached by every thread of the block.

#include "noise.cu"

#ifndef VOCAB
#define VOCAB 256  // V: one logit per byte value (zosoma.config.VOCAB)
#endif
#define LANES 32  // partial maxima / sums per row of logits

#ifdef ZOSOMA_EMULATE
#define DYNAMIC_SHARED(type, name) type* name = (type*)zosoma_emu_shared()
#else
#define DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

__device__ __forceinline__ float fused_sigmoid(float x) {
    return 1.0f / (1.0f + expf(-x));
}

// Shared memory of one block, in floats, in this order (fused_forward.shared_bytes mirrors it):
// the member's d weights, h and c of every layer (2 L B H), the gate pre-activations (B G), the
// logits (B V), the partial maxima and sums (2 B LANES), the row maxima (B); then B doubles.
extern "C" __global__ void fused_population_loss(double* loss, const float* thetas, long long d,
                                                 const unsigned char* batches, int B, int T,
                                                 const int* direction, const float* sign,
                                                 const int* expert, const int* batch,
                                                 const unsigned int* counters, const float* eps,
                                                 int M, int E, int H, int L, int kind) {
    DYNAMIC_SHARED(float, smem);
    const int G = 4 * H;
    const int tid = threadIdx.x, nt = blockDim.x;
    float* w = smem;
    float* state = w + d;                  // (L, 2, B, H): h then c of each layer
    float* gates = state + 2 * L * B * H;  // (B, G)
    float* logits = gates + B * G;         // (B, V)
    float* part = logits + B * VOCAB;      // (B, 2, LANES)
    float* rowmax = part + 2 * B * LANES;  // (B,)
    double* rownll = (double*)(rowmax + B + ((d + B) & 1));  // (B,), 8-byte aligned
    for (int m = blockIdx.x; m < M; m += gridDim.x) {
        // the member's weights: theta + (sign * eps) * delta, as perturb computes them
        const int n = expert[m];
        const float* theta = thetas + (long long)n * d;
        const unsigned int* key = counters + 4 * n;
        const float scale = __fmul_rn(sign[m], eps[n]);
        for (long long g = tid; 4 * g < d; g += nt) {
            float delta[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (scale != 0.0f) noise4((unsigned long long)g, kind, key[0], key[1], (unsigned int)direction[m],
                                      key[3], key[2], delta);
            for (int q = 0; q < 4 && 4 * g + q < d; ++q)
                w[4 * g + q] = scale != 0.0f ? __fadd_rn(theta[4 * g + q], __fmul_rn(scale, delta[q]))
                                             : theta[4 * g + q];
        }
        for (int i = tid; i < 2 * L * B * H; i += nt) state[i] = 0.0f;
        for (int b = tid; b < B; b += nt) rownll[b] = 0.0;
        __syncthreads();
        const unsigned char* rows = batches + (long long)batch[m] * B * (T + 1);
        // views of the weights, the layout of zosoma.model.params
        const float* embed = w;  // (V, E)
        const float* out_w = w + d - VOCAB - (long long)H * VOCAB;  // (H, V)
        const float* out_b = w + d - VOCAB;  // (V,)
        for (int t = 0; t < T; ++t) {
            const float* lw = embed + VOCAB * E;  // this layer's w_ih, then w_hh, bias
            for (int l = 0; l < L; ++l) {
                const int in = l == 0 ? E : H;
                const float* w_ih = lw;
                const float* w_hh = w_ih + in * G;
                const float* bias = w_hh + H * G;
                lw = bias + G;
                float* h = state + 2 * l * B * H;
                float* c = h + B * H;
                const float* below = state + 2 * (l - 1) * B * H;  // layer l-1's h at this step
                for (int i = tid; i < B * G; i += nt) {
                    const int b = i / G, j = i % G;
                    const float* x = l == 0 ? embed + rows[b * (T + 1) + t] * E : below + b * H;
                    float s = 0.0f;
                    for (int k = 0; k < in; ++k) s += x[k] * w_ih[k * G + j];
                    float r = 0.0f;
                    for (int k = 0; k < H; ++k) r += h[b * H + k] * w_hh[k * G + j];
                    gates[i] = r + s + bias[j];
                }
                __syncthreads();
                for (int i = tid; i < B * H; i += nt) {
                    const int b = i / H, j = i % H;
                    const float* z = gates + b * G;
                    const float ig = fused_sigmoid(z[j]), fg = fused_sigmoid(z[H + j]);
                    const float gg = tanhf(z[2 * H + j]), og = fused_sigmoid(z[3 * H + j]);
                    const float cn = fg * c[i] + ig * gg;
                    c[i] = cn;
                    h[i] = og * tanhf(cn);
                }
                __syncthreads();
            }
            const float* top = state + 2 * (L - 1) * B * H;
            for (int i = tid; i < B * VOCAB; i += nt) {
                const int b = i / VOCAB, v = i % VOCAB;
                float s = 0.0f;
                for (int k = 0; k < H; ++k) s += top[b * H + k] * out_w[k * VOCAB + v];
                logits[i] = s + out_b[v];
            }
            __syncthreads();
            // log-softmax of each row: LANES partial maxima, the row's max, LANES partial sums
            for (int i = tid; i < B * LANES; i += nt) {
                const int b = i / LANES, lane = i % LANES;
                const float* z = logits + b * VOCAB;
                float mx = z[lane];
                for (int v = lane + LANES; v < VOCAB; v += LANES) mx = fmaxf(mx, z[v]);
                part[(2 * b) * LANES + lane] = mx;
            }
            __syncthreads();
            for (int b = tid; b < B; b += nt) {
                float mx = part[2 * b * LANES];
                for (int lane = 1; lane < LANES; ++lane) mx = fmaxf(mx, part[2 * b * LANES + lane]);
                rowmax[b] = mx;
            }
            __syncthreads();
            for (int i = tid; i < B * LANES; i += nt) {
                const int b = i / LANES, lane = i % LANES;
                const float* z = logits + b * VOCAB;
                float s = 0.0f;
                for (int v = lane; v < VOCAB; v += LANES) s += expf(z[v] - rowmax[b]);
                part[(2 * b + 1) * LANES + lane] = s;
            }
            __syncthreads();
            for (int b = tid; b < B; b += nt) {
                float s = 0.0f;
                for (int lane = 0; lane < LANES; ++lane) s += part[(2 * b + 1) * LANES + lane];
                const unsigned int y = rows[b * (T + 1) + t + 1];
                rownll[b] += (double)(rowmax[b] + logf(s) - logits[b * VOCAB + y]);
            }
            __syncthreads();
        }
        if (tid == 0) {
            double total = 0.0;
            for (int b = 0; b < B; ++b) total += rownll[b];
            loss[m] = total / ((double)B * T);
        }
        __syncthreads();  // the next member overwrites the weights and the row sums
    }
}

// The fused ZO-SGD update of N experts in one launch: row n of out = (theta_n - lr_n * ghat_n)
// - lr_wd_n * theta_n, ghat_n = sum_k coef[n, k] * delta_k under expert n's counters, every term
// rounded as noise.cu's spsa_update rounds it, so each row is bit-identical to that kernel's update
// of the expert alone. No barrier: one thread per group of 4 parameters of one expert.
//   out, thetas (N, d) (out may be thetas); coef (N, P): coeffs / P as float32;
//   counters (N, 4) uint32 as fused_population_loss's; rates (N, 2): lr, lr * weight_decay
// grid.x over the groups, grid.y over the experts (both grid-stride).
extern "C" __global__ void experts_update(float* out, const float* thetas, const float* coef, int P, long long d,
                                          const unsigned int* counters, const float* rates, int N, int kind) {
    const long long groups = (d + 3) / 4;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (int n = blockIdx.y; n < N; n += gridDim.y) {
        const unsigned int* key = counters + 4 * n;
        const float lr = rates[2 * n], lr_wd = rates[2 * n + 1];
        for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += stride) {
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int k = 0; k < P; ++k) {
                float delta[4];
                noise4((unsigned long long)g, kind, key[0], key[1], (unsigned int)k, key[3], key[2], delta);
                const float c = coef[(long long)n * P + k];
                for (int q = 0; q < 4; ++q) acc[q] = __fadd_rn(acc[q], __fmul_rn(c, delta[q]));
            }
            for (int q = 0; q < 4 && 4 * g + q < d; ++q) {
                const long long i = (long long)n * d + 4 * g + q;
                const float t = thetas[i];
                float v = __fsub_rn(t, __fmul_rn(lr, acc[q]));
                if (lr_wd != 0.0f) v = __fsub_rn(v, __fmul_rn(lr_wd, t));
                out[i] = v;
            }
        }
    }
}
