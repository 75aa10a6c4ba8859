// The router's context embedding on the device (zosoma.engines.cuda.device_routing), the float part
// of zosoma.mixture.cluster.Clustering.embed in the host's order of operations:
//
//   values[p] = tf[count_p] * idf[bucket_p]          (tf: the host's float32 1 + ln(count), a table)
//   values   *= 1 / sqrt(sum_p values[p]^2)           (the sum in double, p in order: _normalize_rows)
//   emb[c]    = sum_p values[p] * projection[bucket_p, c]   (float32, p in order: _csr_times_dense)
//   emb      /= sqrt(sum_c emb[c]^2)                  (the sum in double: _project)
//
// One block per context (grid-stride over rows); threads stride over its entries, then over the D
// columns. Every product and sum is rounded on its own (__fmul_rn, __dadd_rn ...: no fused
// multiply-add), so the values and the projection are the host's bits; only the last norm's double
// sum runs in another order than NumPy's einsum (which may round the float32 norm by an ulp).
//
// CSR input, sorted by (row, bucket) as the host's: indptr (S + 1,), buckets and counts (nnz,) int.

extern "C" __global__ void route_embed(float* emb, float* values, const int* indptr, const int* buckets,
                                       const int* counts, const float* tf, const float* idf,
                                       const float* projection, int S, int D) {
    __shared__ float scale;
    for (int r = blockIdx.x; r < S; r += gridDim.x) {
        const int start = indptr[r], stop = indptr[r + 1];
        float* row = emb + (long long)r * D;
        for (int p = start + threadIdx.x; p < stop; p += blockDim.x)
            values[p] = __fmul_rn(tf[counts[p] - 1], idf[buckets[p]]);
        __syncthreads();
        if (threadIdx.x == 0) {
            double s = 0.0;
            for (int p = start; p < stop; ++p) s = __dadd_rn(s, __dmul_rn((double)values[p], (double)values[p]));
            scale = s > 0.0 ? (float)__ddiv_rn(1.0, sqrt(s)) : 1.0f;
        }
        __syncthreads();
        for (int c = threadIdx.x; c < D; c += blockDim.x) {
            float acc = 0.0f;
            for (int p = start; p < stop; ++p)
                acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(values[p], scale), projection[(long long)buckets[p] * D + c]));
            row[c] = acc;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            double s = 0.0;
            for (int c = 0; c < D; ++c) s = __dadd_rn(s, __dmul_rn((double)row[c], (double)row[c]));
            scale = s > 0.0 ? (float)sqrt(s) : 1.0f;
        }
        __syncthreads();
        for (int c = threadIdx.x; c < D; c += blockDim.x) row[c] = __fdiv_rn(row[c], scale);
        __syncthreads();  // scale is rewritten for the next row
    }
}
