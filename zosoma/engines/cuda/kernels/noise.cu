// Counter-based perturbation noise on the GPU: Philox4x32-10, Rademacher and Gaussian directions,
// the SPSA population builder and the fused SPSA update. Mirrors zosoma/model/noise.py (the
// specification: key/counter layout, bit layout, Box-Muller) and zosoma/engines/ops.py.
//
//   key     = (seed mod 2**32, seed >> 32)
//   counter = (block, member, step, expert)
//   Rademacher: 128 parameters per Philox block, one bit each: delta = 1 - 2*bit
//   Gaussian:   4 parameters per Philox block, Box-Muller on (x0, x1) and (x2, x3)
//
// Every kernel works on groups of 4 consecutive parameters: group g holds parameters 4g..4g+3,
// which is one Philox block of Gaussian noise and one nibble of one 32-bit word of a Rademacher
// block, so both kinds share one loop shape. One thread per group, grid-stride loops with 64-bit
// indices (d up to billions of parameters, rows*d beyond 2**31). No shared memory and no block
// barriers: every thread is independent, so tests/test_kernels.py runs these kernels on the CPU
// through emulate.h.
//
// Launch (zosoma/engines/cuda/custom_kernels.py): block = (256, 1, 1); grid.x = min(ceil(groups / 256), cap);
// perturb also uses grid.y over pairs of rows (grid-stride as well).
//
// Rounding: out = base + scale*delta with the product and the sum rounded separately
// (__fmul_rn/__fadd_rn are never fused into an FMA), exactly as the CPU code rounds, so Rademacher
// results are bit-identical to zosoma.model.noise / zosoma.engines.ops. Gaussian values agree within float32
// rounding (the CPU computes them in float64).

struct Philox4 {
    unsigned int x0, x1, x2, x3;
};

// Philox4x32-10 (Salmon et al. 2011) of counter (c0..c3) under key (k0, k1).
// CPU: zosoma.model.noise.philox4x32_10.
__device__ __forceinline__ Philox4 philox4x32_10(unsigned int c0, unsigned int c1, unsigned int c2,
                                                 unsigned int c3, unsigned int k0, unsigned int k1) {
    for (int round = 0; round < 10; ++round) {
        const unsigned int hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const unsigned int hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        const unsigned int n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
        k0 += 0x9E3779B9u;  // Weyl key increments
        k1 += 0xBB67AE85u;
    }
    Philox4 r = {c0, c1, c2, c3};
    return r;
}

// One Box-Muller pair from two uint32 words: (r cos 2 pi u2, r sin 2 pi u2) with
// u = (word + 0.5) * 2**-32. Each uniform is measured from its nearer end of (0, 1), so float32
// keeps full relative precision where it matters: near u1 = 1 (r small) log1p of the distance to 1,
// near u2 = 1 an angle just below zero (same sine and cosine as just below 2 pi).
__device__ __forceinline__ void box_muller(unsigned int a, unsigned int b, float* out) {
    const float two_m32 = 2.3283064365386963e-10f;  // 2**-32
    const float two_m31 = 4.6566128730773926e-10f;  // 2**-31
    float ln_u1;
    if (a < 0x80000000u) {
        ln_u1 = logf(((float)a + 0.5f) * two_m32);
    } else {
        ln_u1 = log1pf(-(((float)(~a) + 0.5f) * two_m32));  // 1 - u1 = (~a + 0.5) * 2**-32
    }
    const float r = sqrtf(-2.0f * ln_u1);
    // 2 pi u2 = pi * y with y = 2 u2 in (0, 2); above 1, use y - 2 = -(2 - y) in (-1, 0)
    const float y = b < 0x80000000u ? ((float)b + 0.5f) * two_m31 : -(((float)(~b) + 0.5f) * two_m31);
    float s, c;
    sincospif(y, &s, &c);
    out[0] = r * c;
    out[1] = r * s;
}

// delta of parameters 4g..4g+3 of direction `member`: noise.noise(...)[4g:4g+4].
// kind: 0 Rademacher, 1 Gaussian (zosoma.model.noise.RADEMACHER / GAUSSIAN).
__device__ __forceinline__ void noise4(unsigned long long g, int kind, unsigned int k0, unsigned int k1,
                                       unsigned int member, unsigned int step, unsigned int expert,
                                       float* delta) {
    if (kind == 0) {
        // element i = 4g + q: block i >> 7 = g >> 5, word (i & 127) >> 5 = (g >> 3) & 3,
        // bit (i & 31) = 4 * (g & 7) + q
        const Philox4 x = philox4x32_10((unsigned int)(g >> 5), member, step, expert, k0, k1);
        const unsigned int sel = (unsigned int)(g >> 3) & 3u;
        const unsigned int word = sel == 0 ? x.x0 : sel == 1 ? x.x1 : sel == 2 ? x.x2 : x.x3;
        const unsigned int bits = word >> (4u * ((unsigned int)g & 7u));
        for (int q = 0; q < 4; ++q) delta[q] = ((bits >> q) & 1u) ? -1.0f : 1.0f;
    } else {
        const Philox4 x = philox4x32_10((unsigned int)g, member, step, expert, k0, k1);
        box_muller(x.x0, x.x1, delta);
        box_muller(x.x2, x.x3, delta + 2);
    }
}

// Philox known answers, for tests: out[4i..4i+3] = philox4x32_10(c0, c1, c2, c3, k0, k1) of
// counters[6i..6i+5] = (c0, c1, c2, c3, k0, k1). counters (n, 6), out (n, 4).
extern "C" __global__ void philox_blocks(const unsigned int* counters, unsigned int* out, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const unsigned int* c = counters + 6 * i;
        const Philox4 x = philox4x32_10(c[0], c[1], c[2], c[3], c[4], c[5]);
        out[4 * i] = x.x0;
        out[4 * i + 1] = x.x1;
        out[4 * i + 2] = x.x2;
        out[4 * i + 3] = x.x3;
    }
}

// Perturbed copies of base, one row per member of a member table (zosoma/model/population.py).
// CPU: zosoma.model.noise.add_noise (one row, sign +1) and zosoma.engines.ops.perturbed.
//   out        (rows, n): row j = base + (sign[j] * scale) * delta_{direction[j]}
//   base       (n,); may alias out when there is a single row (in-place update)
//   direction  (rows,) int32: each row's direction, the noise's member counter
//   sign       (rows,) float32: +1 or -1 (sign * scale is exact)
//   g0         first group's index in the whole vector: the slice starts at parameter 4 * g0
// grid.x over the ceil(n / 4) groups, grid.y over pairs of rows (2p, 2p+1); each thread draws one
// group's noise once per pair when both rows share a direction (an antithetic pair), else once
// per row, and writes it to the pair's rows.
extern "C" __global__ void perturb(float* out, const float* base, long long n, float scale,
                                   long long g0, unsigned int k0, unsigned int k1, unsigned int expert,
                                   unsigned int step, const int* direction, const float* sign, int rows,
                                   int kind) {
    const long long groups = (n + 3) / 4;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (int p = blockIdx.y; 2 * p < rows; p += gridDim.y) {
        const int a = 2 * p, b = 2 * p + 1;
        const bool second = b < rows, shared = second && direction[b] == direction[a];
        const float scale_a = sign[a] * scale, scale_b = second ? sign[b] * scale : 0.0f;
        for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += stride) {
            float delta[4];
            noise4((unsigned long long)(g0 + g), kind, k0, k1, (unsigned int)direction[a], step, expert, delta);
            for (int q = 0; q < 4; ++q) {
                const long long i = 4 * g + q;
                if (i < n) out[(long long)a * n + i] = __fadd_rn(base[i], __fmul_rn(scale_a, delta[q]));
            }
            if (!second) continue;
            if (!shared) noise4((unsigned long long)(g0 + g), kind, k0, k1, (unsigned int)direction[b], step, expert,
                                delta);
            for (int q = 0; q < 4; ++q) {
                const long long i = 4 * g + q;
                if (i < n) out[(long long)b * n + i] = __fadd_rn(base[i], __fmul_rn(scale_b, delta[q]));
            }
        }
    }
}

// The SPSA estimate ghat = sum_k coef[k] * delta_k, regenerating each direction on the fly (no
// delta is ever stored), then either written out or applied as a ZO-SGD step:
//   apply = 0: out = ghat                                     CPU: zosoma.engines.ops.Ops.noise_sum
//   apply = 1: out = (theta - lr * ghat) - lr_wd * theta      CPU: zosoma.engines.ops.Ops.sgd_update
// coef (P,) are the float32 values of coeffs[k] / P; lr and lr_wd = lr * weight_decay float32.
// The sum runs over k = 0..P-1 in order with float32 rounding after each term, as the CPU adds the
// directions one by one, so Rademacher estimates and updates are bit-identical to the CPU's.
// theta (n,) may alias out; with apply = 0 theta is not read.
extern "C" __global__ void spsa_update(float* out, const float* theta, const float* coef, int P,
                                       long long n, unsigned int k0, unsigned int k1,
                                       unsigned int expert, unsigned int step, int kind, int apply,
                                       float lr, float lr_wd) {
    const long long groups = (n + 3) / 4;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += stride) {
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int k = 0; k < P; ++k) {
            float delta[4];
            noise4((unsigned long long)g, kind, k0, k1, (unsigned int)k, step, expert, delta);
            const float c = coef[k];
            for (int q = 0; q < 4; ++q) acc[q] = __fadd_rn(acc[q], __fmul_rn(c, delta[q]));
        }
        for (int q = 0; q < 4; ++q) {
            const long long i = 4 * g + q;
            if (i >= n) break;
            if (apply) {
                const float t = theta[i];
                float v = __fsub_rn(t, __fmul_rn(lr, acc[q]));
                if (lr_wd != 0.0f) v = __fsub_rn(v, __fmul_rn(lr_wd, t));
                out[i] = v;
            } else {
                out[i] = acc[q];
            }
        }
    }
}
