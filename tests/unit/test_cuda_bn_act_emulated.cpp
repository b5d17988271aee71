/* The fused batch norm + residual add + ReLU kernels (worker/cuda/ops/cuda_bn_act_kernels.cuh) run
 * as host C++ on CPU threads, one std::thread per CUDA thread of a block (a barrier for
 * __syncthreads, an exchange array for the warp shuffles), launched with the grids
 * cuda_bn_act.cu computes, against a plain double-precision reference: statistics, y, dx, the
 * residual's gradient, dgamma, dbeta, in fp32 (16-byte and scalar paths), bf16 and fp16, with and
 * without residual and ReLU, written or added. Catches the kernels' indexing and reductions where
 * no GPU is; tests/unit/test_cuda_fused.c runs the same kernels on a GPU. */
#include <criterion/criterion.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_types.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <thread>
#include <type_traits>
#include <vector>

/* ---- a CUDA block on CPU threads ---- */

#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline

typedef __nv_bfloat16 bf16;
typedef __half f16;

struct idx3 {
    unsigned x, y, z;
};
static thread_local idx3 threadIdx, blockIdx;
static idx3 blockDim, gridDim;

/* all threads of the emulated block wait here (generation counting: reusable); waiting threads
 * yield the core rather than sleep: a block's threads outnumber the cores, and a sleep and wake
 * per __syncthreads costs far more */
class block_barrier {
  public:
    explicit block_barrier(unsigned n) : n_(n) {}
    void wait() {
        unsigned gen = gen_.load(std::memory_order_acquire);
        if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
            arrived_.store(0, std::memory_order_relaxed);
            gen_.store(gen + 1, std::memory_order_release);
        } else {
            while (gen_.load(std::memory_order_acquire) == gen)
                std::this_thread::yield();
        }
    }

  private:
    unsigned n_;
    std::atomic<unsigned> arrived_{0}, gen_{0};
};

static block_barrier *emu_barrier;
static float *emu_smem;
static double emu_exchange[1024];

#define __syncthreads()            emu_barrier->wait()
#define BN_ACT_SHARED_FLOATS(name) float *name = emu_smem

/* a warp is the whole (32-thread) block in the kernels that shuffle */
static double __shfl_xor_sync(unsigned, double v, int off) {
    unsigned lane = threadIdx.x;
    emu_exchange[lane] = v;
    emu_barrier->wait();
    double other = emu_exchange[lane ^ (unsigned)off];
    emu_barrier->wait();
    return other;
}

#include "bn_act.h"
#include "cuda_bn_act_kernels.cuh"

/* The grid's blocks one after the other on one set of threads (a barrier between blocks). */
static void launch(unsigned grid, unsigned bx, unsigned by, size_t smem_bytes,
                   const std::function<void()> &f) {
    gridDim = {grid, 1, 1};
    blockDim = {bx, by, 1};
    std::vector<float> smem(smem_bytes / sizeof(float) + 1);
    block_barrier barrier(bx * by);
    emu_smem = smem.data();
    emu_barrier = &barrier;
    std::vector<std::thread> threads;
    for (unsigned y = 0; y < by; y++)
        for (unsigned x = 0; x < bx; x++)
            threads.emplace_back([=, &f, &barrier] {
                threadIdx = {x, y, 0};
                for (unsigned b = 0; b < grid; b++) {
                    blockIdx = {b, 0, 0};
                    f();
                    barrier.wait(); /* every thread is done with block b and its shared memory */
                }
            });
    for (auto &t : threads)
        t.join();
}

/* ---- one case against a double-precision reference ---- */

template <typename T> static T from_float(float v) {
    return from_f<T>(v);
}

static uint64_t rng_state = 77;
static float uniform() {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(rng_state >> 40) / 16777216.0 * 2.0 - 1.0);
}

/* every input exact in bf16 and fp16 alike */
static float narrow_exact(float v) {
    return __half2float(__float2half(__bfloat162float(__float2bfloat16(v))));
}

static void expect_near(const char *what, const std::vector<double> &want,
                        const std::vector<float> &got, double tol, const char *label) {
    double scale = 1e-6, err = 0;
    for (double w : want)
        scale = std::max(scale, std::fabs(w));
    size_t worst = 0;
    for (size_t i = 0; i < want.size(); i++) {
        double e = std::fabs(want[i] - (double)got[i]);
        if (!(e <= err)) { /* a NaN is the worst */
            err = e;
            worst = i;
        }
    }
    cr_assert(err <= tol * scale, "%s %s: |reference - kernel| %g at %zu (%g vs %g), scale %g",
              label, what, err, worst, want[worst], (double)got[worst], scale);
}

/* sm: the multiprocessor count the grids are sized for (small: several blocks, several rows per
 * thread, as on a GPU with large tensors) */
template <typename T, int V>
static void emulated_case(size_t rows, int c, bool has_relu, bool has_res, bool is_written,
                          int sm) {
    size_t n = rows * (size_t)c;
    std::vector<float> x(n), res(n), dy(n), start(n), gamma(c), beta(c);
    for (size_t i = 0; i < n; i++) {
        x[i] = narrow_exact(2.0f * uniform() + 0.5f);
        res[i] = narrow_exact(uniform());
        dy[i] = narrow_exact(uniform());
        start[i] = narrow_exact(uniform());
    }
    for (int j = 0; j < c; j++) {
        gamma[j] = uniform() + 0.2f;
        beta[j] = uniform();
    }
    /* the kernels, in T */
    std::vector<T> xt(n), rt(n), yt(n), dyt(n), dxt(n), drt(n);
    for (size_t i = 0; i < n; i++) {
        xt[i] = from_float<T>(x[i]);
        rt[i] = from_float<T>(res[i]);
        dyt[i] = from_float<T>(dy[i]);
        dxt[i] = from_float<T>(is_written ? NAN : start[i]);
        drt[i] = from_float<T>(is_written ? NAN : start[i]);
        yt[i] = from_float<T>(NAN);
    }
    act_grid a = grid_for(c, V);
    size_t most = (rows + a.by - 1) / a.by, room = ((size_t)2 << 20) / (2 * (size_t)c);
    unsigned blocks = (unsigned)std::max<size_t>(1, std::min({4 * (size_t)sm, most, room}));
    unsigned apply = (unsigned)std::max<size_t>(1, std::min(16 * (size_t)sm, most));
    std::vector<float> p(2 * (size_t)blocks * c), save(2 * c), run(2 * c), coeffs(3 * c),
        dg(c, 1.0f), db(c, 1.0f);
    for (int j = 0; j < c; j++)
        run[j] = 0.0f, run[c + j] = 1.0f;
    float *p1 = p.data(), *p2 = p.data() + (size_t)blocks * c;
    size_t smem = 2 * sizeof(float) * a.bx * a.by * V;
    const T *resp = has_res ? rt.data() : nullptr;
    launch(blocks, a.bx, a.by, smem, [&] {
        act_partials_kernel<T, V>(rows, c, a, xt.data(), (const T *)nullptr, (const T *)nullptr,
                                  false, nullptr, nullptr, p1, p2);
    });
    launch(c, 32, 1, 0, [&] {
        act_stats_kernel<T>(c, (int)blocks, rows, xt.data(), p1, p2, save.data(), save.data() + c,
                            run.data(), run.data() + c, 0.1f, 1e-5f);
    });
    launch(apply, a.bx, a.by, 0, [&] {
        act_apply_kernel<T, V>(rows, c, a, xt.data(), resp, has_relu, save.data(), save.data() + c,
                               nullptr, 1e-5f, gamma.data(), beta.data(), yt.data());
    });
    launch(blocks, a.bx, a.by, smem, [&] {
        act_partials_kernel<T, V>(rows, c, a, xt.data(), yt.data(), dyt.data(), has_relu,
                                  save.data(), save.data() + c, p1, p2);
    });
    launch(c, 32, 1, 0, [&] {
        act_coeffs_kernel(c, (int)blocks, rows, p1, p2, gamma.data(), save.data() + c,
                          coeffs.data(), dg.data(), db.data());
    });
    launch(apply, a.bx, a.by, 0, [&] {
        act_dx_kernel<T, V>(rows, c, a, xt.data(), yt.data(), dyt.data(), has_relu, save.data(),
                            coeffs.data(), is_written, dxt.data(), is_written,
                            has_res ? drt.data() : nullptr);
    });
    /* the reference */
    std::vector<double> mean(c), invstd(c), y(n), dx(n), dres(n), dgw(c), dbw(c), run_var(c);
    for (int j = 0; j < c; j++) {
        double s1 = 0, s2 = 0;
        for (size_t r = 0; r < rows; r++)
            s1 += x[r * c + j];
        mean[j] = s1 / (double)rows;
        for (size_t r = 0; r < rows; r++)
            s2 += (x[r * c + j] - mean[j]) * (x[r * c + j] - mean[j]);
        invstd[j] = 1.0 / std::sqrt(s2 / (double)rows + 1e-5);
        run_var[j] = 0.9 + 0.1 * s2 / (double)(rows - 1);
    }
    std::vector<float> y_stored(n), got(n);
    for (size_t i = 0; i < n; i++) {
        int j = (int)(i % (size_t)c);
        double v = (x[i] - mean[j]) * invstd[j] * gamma[j] + beta[j] + (has_res ? res[i] : 0.0);
        y[i] = has_relu ? std::max(v, 0.0) : v;
        y_stored[i] = to_f(yt[i]); /* the mask is the stored output's sign, on either side */
    }
    for (int j = 0; j < c; j++) {
        double sum_dz = 0, sum_dz_xhat = 0;
        for (size_t r = 0; r < rows; r++) {
            size_t i = r * c + j;
            double dz = !has_relu || y_stored[i] > 0.0f ? dy[i] : 0.0;
            sum_dz += dz;
            sum_dz_xhat += dz * (x[i] - mean[j]) * invstd[j];
        }
        dgw[j] = 1.0 + sum_dz_xhat;
        dbw[j] = 1.0 + sum_dz;
        for (size_t r = 0; r < rows; r++) {
            size_t i = r * c + j;
            double dz = !has_relu || y_stored[i] > 0.0f ? dy[i] : 0.0;
            double xhat = (x[i] - mean[j]) * invstd[j];
            dx[i] = gamma[j] * invstd[j] / (double)rows *
                        ((double)rows * dz - sum_dz - xhat * sum_dz_xhat) +
                    (is_written ? 0.0 : start[i]);
            dres[i] = dz + (is_written ? 0.0 : start[i]);
        }
    }
    char label[160];
    snprintf(label, sizeof label,
             "%s V%d rows %zu C %d relu %d residual %d written %d (blocks %u/%u of %ux%u)",
             std::is_same<T, float>::value  ? "fp32"
             : std::is_same<T, bf16>::value ? "bf16"
                                            : "fp16",
             V, rows, c, has_relu, has_res, is_written, blocks, apply, a.bx, a.by);
    bool low = sizeof(T) == 2;
    auto wide = [&](const std::vector<T> &v) {
        for (size_t i = 0; i < n; i++)
            got[i] = to_f(v[i]);
        return got;
    };
    expect_near("mean", mean, std::vector<float>(save.begin(), save.begin() + c), 1e-5, label);
    expect_near("invstd", invstd, std::vector<float>(save.begin() + c, save.end()), 1e-4, label);
    expect_near("running var", run_var, std::vector<float>(run.begin() + c, run.end()), 1e-4,
                label);
    expect_near("y", y, wide(yt), low ? 1e-2 : 1e-5, label);
    expect_near("dx", dx, wide(dxt), low ? 2e-2 : 1e-4, label);
    if (has_res) expect_near("dresidual", dres, wide(drt), low ? 1e-2 : 1e-6, label);
    expect_near("dgamma", dgw, dg, 1e-4, label);
    expect_near("dbeta", dbw, db, 1e-4, label);
}

template <typename T, int V> static void all_combos(size_t rows, int c, int sm) {
    for (int combo = 0; combo < 8; combo++)
        emulated_case<T, V>(rows, c, combo & 1, combo & 2, combo & 4, sm);
}

TestSuite(cuda_bn_act_emulated, .timeout = 240);

/* 16-byte vectors: 4 fp32, 8 bf16 or fp16 channels per thread; several blocks of rows */
Test(cuda_bn_act_emulated, vector_paths) {
    all_combos<float, 4>(300, 24, 3);
    all_combos<bf16, 8>(300, 24, 3);
    all_combos<f16, 8>(257, 64, 2);
}

/* one value per thread: C not a multiple of the width, or a misaligned tensor */
Test(cuda_bn_act_emulated, scalar_paths) {
    all_combos<float, 1>(50, 7, 3);
    all_combos<f16, 1>(33, 12, 2);
    all_combos<bf16, 1>(40, 5, 1);
}

/* more channel vectors than a block is wide: each thread walks several (fp32 at C 1032: 258
 * vectors, a round of 256 then one of 2, where most threads have none) */
Test(cuda_bn_act_emulated, channels_beyond_one_block) {
    emulated_case<float, 4>(24, 1032, true, true, true, 1);
}
