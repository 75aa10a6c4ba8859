// Runs zosoma's CUDA kernels on the CPU, for tests on machines without a GPU.
//
// Compile a kernel file as C++ with this header forced in front of it:
//     g++ -std=c++17 -O2 -shared -fPIC -ffp-contract=off -include emulate.h -x c++ wrapper.cpp
// where wrapper.cpp #includes the .cu file and exports each kernel with ZOSOMA_EMU_EXPORT(name).
// The export takes the launch as CUDA's driver API does (cuLaunchKernel): grid and block as three
// unsigned ints each, and an array of pointers to the kernel's arguments. tests/test_kernels.py
// builds those from the kernel's signature (zosoma.engines.cuda.kernel_signatures).
//
// Execution model: the blocks of a launch, and the threads of each block, run one after another on
// the calling thread, with blockIdx/threadIdx/blockDim/gridDim set for each. That is faithful for
// kernels whose threads never wait for one another, which is how zosoma's kernels are written;
// block barriers and shared memory would need threads that run together, so __syncthreads and
// __shared__ are left undefined here: a kernel that uses them does not compile under emulation.
// -ffp-contract=off keeps g++ from fusing a*b+c, so __fmul_rn/__fadd_rn round as on the GPU.
#pragma once

#include <math.h>

#include <cstddef>
#include <type_traits>
#include <utility>

#define ZOSOMA_EMULATE 1
#define __global__
#define __device__ static
#define __host__
#define __forceinline__ inline

struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
};

static thread_local uint3 threadIdx, blockIdx;
static thread_local dim3 blockDim, gridDim;

// CUDA intrinsics, with the semantics of the CUDA math API. expf, logf, log1pf, tanhf, sqrtf,
// fmaxf come from <math.h> (glibc's are correctly rounded or within an ulp or two, like CUDA's).
static inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * b) >> 32);
}
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline void sincospif(float x, float* s, float* c) {  // sin(pi x), cos(pi x)
    const double a = 3.14159265358979323846 * (double)x;
    *s = (float)sin(a);
    *c = (float)cos(a);
}

// Calls fn with its arguments read from args[i] (each a pointer to the i-th argument).
template <class... A, std::size_t... I>
static void zosoma_emu_call(void (*fn)(A...), void** args, std::index_sequence<I...>) {
    fn(*static_cast<typename std::remove_cv<A>::type*>(args[I])...);
}

template <class... A>
static void zosoma_emu_launch(void (*fn)(A...), const unsigned int* grid, const unsigned int* block,
                              void** args) {
    gridDim = {grid[0], grid[1], grid[2]};
    blockDim = {block[0], block[1], block[2]};
    for (unsigned int bz = 0; bz < grid[2]; ++bz)
        for (unsigned int by = 0; by < grid[1]; ++by)
            for (unsigned int bx = 0; bx < grid[0]; ++bx)
                for (unsigned int tz = 0; tz < block[2]; ++tz)
                    for (unsigned int ty = 0; ty < block[1]; ++ty)
                        for (unsigned int tx = 0; tx < block[0]; ++tx) {
                            blockIdx = {bx, by, bz};
                            threadIdx = {tx, ty, tz};
                            zosoma_emu_call(fn, args, std::index_sequence_for<A...>{});
                        }
}

#define ZOSOMA_EMU_EXPORT(kernel)                                                           \
    extern "C" void emu_##kernel(const unsigned int* grid, const unsigned int* block,       \
                                 void** args) {                                             \
        zosoma_emu_launch(kernel, grid, block, args);                                       \
    }
