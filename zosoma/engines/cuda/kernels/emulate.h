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
// kernels whose threads never wait for one another (ZOSOMA_EMU_EXPORT, the fast path).
// Kernels with block barriers and shared memory (ZOSOMA_EMU_EXPORT_BLOCK) run each thread of a
// block as a fiber (ucontext) on the calling thread: a thread runs until it reaches __syncthreads,
// then the next one, and the block goes on when every thread has arrived, as on the GPU. A block's
// dynamic shared memory (zosoma_emu_shared) and its static __shared__ arrays are plain memory that
// its fibers share; a barrier that some threads skip while others wait is reported and aborts.
// -ffp-contract=off keeps g++ from fusing a*b+c, so __fmul_rn/__fadd_rn round as on the GPU.
#pragma once

#include <math.h>

#include <ucontext.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <utility>
#include <vector>

#define ZOSOMA_EMULATE 1
#define __global__
#define __device__ static
#define __host__
#define __forceinline__ inline
#define __shared__ static

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
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
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

// --- cooperative blocks: one fiber per thread, __syncthreads switches between them ----------------

enum { ZOSOMA_FIBER_READY, ZOSOMA_FIBER_WAITING, ZOSOMA_FIBER_DONE };
static const std::size_t ZOSOMA_FIBER_STACK = 256 << 10;  // bytes; committed only where touched

struct ZosomaBlock {
    ucontext_t scheduler;
    std::vector<ucontext_t> ctx;
    std::vector<void*> stacks;
    std::vector<int> state;
    unsigned int current = 0;
    void (*entry)(void*) = nullptr;
    void* arg = nullptr;
    std::vector<double> shared;  // dynamic shared memory (doubles: 8-byte aligned)
    ~ZosomaBlock() {
        for (void* s : stacks) free(s);
    }
};
static thread_local ZosomaBlock* zosoma_emu_block = nullptr;

static inline void* zosoma_emu_shared() { return zosoma_emu_block->shared.data(); }

static inline void __syncthreads() {
    ZosomaBlock* blk = zosoma_emu_block;
    if (blk == nullptr) {
        fprintf(stderr, "emulate.h: __syncthreads in a kernel exported with ZOSOMA_EMU_EXPORT\n");
        abort();
    }
    blk->state[blk->current] = ZOSOMA_FIBER_WAITING;
    swapcontext(&blk->ctx[blk->current], &blk->scheduler);
}

static void zosoma_emu_fiber() {
    ZosomaBlock* blk = zosoma_emu_block;
    blk->entry(blk->arg);
    blk->state[blk->current] = ZOSOMA_FIBER_DONE;  // then uc_link returns to the scheduler
}

template <class... A>
struct ZosomaCall {
    void (*fn)(A...);
    void** args;
    static void run(void* self) {
        ZosomaCall* c = static_cast<ZosomaCall*>(self);
        zosoma_emu_call(c->fn, c->args, std::index_sequence_for<A...>{});
    }
};

// Runs one block: every thread as a fiber, round after round until all have returned.
static void zosoma_emu_run_block(ZosomaBlock& blk, unsigned int threads) {
    for (unsigned int i = 0; i < threads; ++i) {
        getcontext(&blk.ctx[i]);
        blk.ctx[i].uc_stack.ss_sp = blk.stacks[i];
        blk.ctx[i].uc_stack.ss_size = ZOSOMA_FIBER_STACK;
        blk.ctx[i].uc_link = &blk.scheduler;
        makecontext(&blk.ctx[i], zosoma_emu_fiber, 0);
        blk.state[i] = ZOSOMA_FIBER_READY;
    }
    for (;;) {
        for (unsigned int i = 0; i < threads; ++i) {
            if (blk.state[i] != ZOSOMA_FIBER_READY) continue;
            blk.current = i;
            threadIdx = {i % blockDim.x, (i / blockDim.x) % blockDim.y, i / (blockDim.x * blockDim.y)};
            swapcontext(&blk.scheduler, &blk.ctx[i]);
        }
        unsigned int waiting = 0;
        for (unsigned int i = 0; i < threads; ++i) waiting += blk.state[i] == ZOSOMA_FIBER_WAITING;
        if (waiting == 0) return;
        if (waiting != threads) {
            fprintf(stderr, "emulate.h: %u of %u threads wait at __syncthreads, the others returned\n",
                    waiting, threads);
            abort();
        }
        for (unsigned int i = 0; i < threads; ++i) blk.state[i] = ZOSOMA_FIBER_READY;
    }
}

template <class... A>
static void zosoma_emu_launch_block(void (*fn)(A...), const unsigned int* grid, const unsigned int* block,
                                    unsigned int shared_bytes, void** args) {
    gridDim = {grid[0], grid[1], grid[2]};
    blockDim = {block[0], block[1], block[2]};
    const unsigned int threads = block[0] * block[1] * block[2];
    ZosomaBlock blk;
    blk.ctx.resize(threads);
    blk.state.resize(threads);
    for (unsigned int i = 0; i < threads; ++i) blk.stacks.push_back(malloc(ZOSOMA_FIBER_STACK));
    blk.shared.resize((shared_bytes + 7) / 8 + 1);
    ZosomaCall<A...> call = {fn, args};
    blk.entry = ZosomaCall<A...>::run;
    blk.arg = &call;
    zosoma_emu_block = &blk;
    for (unsigned int bz = 0; bz < grid[2]; ++bz)
        for (unsigned int by = 0; by < grid[1]; ++by)
            for (unsigned int bx = 0; bx < grid[0]; ++bx) {
                blockIdx = {bx, by, bz};
                zosoma_emu_run_block(blk, threads);
            }
    zosoma_emu_block = nullptr;
}

// A kernel with block barriers or shared memory: the launch takes its dynamic shared memory in
// bytes too (cuLaunchKernel's sharedMemBytes).
#define ZOSOMA_EMU_EXPORT_BLOCK(kernel)                                                     \
    extern "C" void emu_##kernel(const unsigned int* grid, const unsigned int* block,       \
                                 unsigned int shared_bytes, void** args) {                  \
        zosoma_emu_launch_block(kernel, grid, block, shared_bytes, args);                   \
    }

#define ZOSOMA_EMU_EXPORT(kernel)                                                           \
    extern "C" void emu_##kernel(const unsigned int* grid, const unsigned int* block,       \
                                 void** args) {                                             \
        zosoma_emu_launch(kernel, grid, block, args);                                       \
    }
