// SinkGD's Sinkhorn scales on the CPU, as one XLA FFI call per gradient leaf.
//
// The Python side is sage_optax/sinkgd_native.py (it compiles this file on first use and
// registers the handler with jax.ffi); docs/algorithms.md, "The CPU's native scales",
// gives the math.  For each matrix G of a (B, R, C) view (batch, rows, columns; the rows
// are the fan-in group of a Flax kernel (in, out) when rows_in, else the fan-out group of
// a torch weight (out, in)) it computes the scales of the range-scaled iteration of
// sage_optax.sinkgd.sinkhorn_scales:
//
//   m = the power of two with m <= max|G| < 2m (1 for a zero or non-finite max; within
//       [2^-126, 2^126]),  K = (G/m)^2,  c = 1 (fan-in),  r = 1 (fan-out),
//   L times:  r <- r t_in  / (r ||.|| + eps_i),  ||.||^2 = the sums of K over the fan-in,
//             weighted by c^2  (eps_0 = eps/m, then eps),
//             c <- c t_out / (c ||.|| + eps),    the sums over the fan-out weighted by r^2,
//   a scale whose slice sums to 0 is kept;  then c /= h, r /= m/h with h = 2^floor(k/2)
//   for m = 2^k (X = c G r stays finite for any finite G).
//
// K is never stored: a pass squares two rows of G/m at a time (read from the core's cache
// twice, once for their own sums and once for their share of the other direction's), so
// one pass over G does a whole iteration.  A first pass finds max|G|.  The rows are cut
// into chunks fixed by the shape; each chunk accumulates its own column sums, which are
// added in chunk order afterwards, so the result does not depend on how many threads ran
// or which chunk each took (deterministic).  The chunks of a pass are shared with helper
// threads (Helpers below), as many as XLA's intra-op pool has threads besides the caller.

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kChunkRows = 32;  // at least this many rows per chunk
constexpr int64_t kMaxChunks = 64;  // at most this many chunks (and column-sum buffers)
constexpr int kLanes = 32;  // independent partial sums per row: lets the compiler vectorise

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SAGE_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define SAGE_CLONES
#endif

inline float Widen(float x) { return x; }
inline float Widen(uint16_t x) {  // bfloat16: the top half of a float32, exactly
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The power of two m <= a < 2m (1 where a is 0 or not finite), within [2^-126, 2^126].
float Pow2Floor(float a) {
  if (!(a > 0) || !std::isfinite(a)) return 1.0f;
  int e;
  std::frexp(a, &e);  // a = f 2^e, f in [0.5, 1)
  return std::ldexp(1.0f, std::clamp(e - 1, -126, 126));
}

// 2^floor(k/2) for m = 2^k.
float Pow2SqrtFloor(float m) {
  int e;
  std::frexp(m, &e);  // m = 0.5 2^e: k = e - 1
  int k = e - 1;
  return std::ldexp(1.0f, k >= 0 ? k / 2 : -((-k + 1) / 2));
}

inline float Rescale(float scale, float norm_sq, float target, float eps) {
  float norm = std::sqrt(norm_sq);
  return norm > 0 ? scale * target / (scale * norm + eps) : scale;
}

// The largest magnitude (NaN if an entry is NaN) and the smallest non-zero one (inf if none).
template <typename T>
SAGE_CLONES void Extremes(const T* g, int64_t n, float* largest, float* smallest) {
  float hi[kLanes] = {0}, lo[kLanes];
  int nan[kLanes] = {0};
  for (int l = 0; l < kLanes; ++l) lo[l] = INFINITY;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      float a = std::fabs(Widen(g[j + l]));
      hi[l] = std::max(hi[l], a);
      lo[l] = std::min(lo[l], a == 0 ? INFINITY : a);
      nan[l] |= a != a;
    }
  float best = 0, least = INFINITY;
  int any_nan = 0;
  for (; j < n; ++j) {
    float a = std::fabs(Widen(g[j]));
    best = std::max(best, a);
    least = std::min(least, a == 0 ? INFINITY : a);
    any_nan |= a != a;
  }
  for (int l = 0; l < kLanes; ++l) {
    best = std::max(best, hi[l]);
    least = std::min(least, lo[l]);
    any_nan |= nan[l];
  }
  *largest = any_nan ? NAN : best;
  *smallest = least;
}

// Asks for the cache line 1 KiB ahead of p (the hardware prefetcher alone left the passes
// over a matrix in the last-level cache ~15% slower on this project's CPU).
template <typename T>
inline void Prefetch(const T* p) {
  __builtin_prefetch(reinterpret_cast<const char*>(p) + 1024);
}

// An entry of G/m (kScale), or of G where the range scale is folded into the weights.
template <bool kScale, typename T>
inline float Load(T g, float s) {
  return kScale ? Widen(g) * s : Widen(g);
}

// The sums of rows g0 and g1 of (G/m)^2 (s = 1/m) against the weights w, into out[0..1].
template <bool kScale, typename T>
SAGE_CLONES void RowSums2(const T* g0, const T* g1, int64_t n, float s, const float* w,
                          float* out) {
  float a0[kLanes] = {0}, a1[kLanes] = {0};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    Prefetch(g0 + j);
    Prefetch(g1 + j);
    for (int l = 0; l < kLanes; ++l) {
      float x0 = Load<kScale>(g0[j + l], s), x1 = Load<kScale>(g1[j + l], s);
      a0[l] += x0 * x0 * w[j + l];
      a1[l] += x1 * x1 * w[j + l];
    }
  }
  float s0 = 0, s1 = 0;
  for (int l = 0; l < kLanes; ++l) {
    s0 += a0[l];
    s1 += a1[l];
  }
  for (; j < n; ++j) {
    float x0 = Load<kScale>(g0[j], s), x1 = Load<kScale>(g1[j], s);
    s0 += x0 * x0 * w[j];
    s1 += x1 * x1 * w[j];
  }
  out[0] = s0;
  out[1] = s1;
}

template <bool kScale, typename T>
SAGE_CLONES float RowSum(const T* g0, int64_t n, float s, const float* w) {
  float a0[kLanes] = {0};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    Prefetch(g0 + j);
    for (int l = 0; l < kLanes; ++l) {
      float x0 = Load<kScale>(g0[j + l], s);
      a0[l] += x0 * x0 * w[j + l];
    }
  }
  float s0 = 0;
  for (int l = 0; l < kLanes; ++l) s0 += a0[l];
  for (; j < n; ++j) {
    float x0 = Load<kScale>(g0[j], s);
    s0 += x0 * x0 * w[j];
  }
  return s0;
}

// acc += (g0 s)^2 w0, then += (g1 s)^2 w1 (one load and store of acc for two rows).
template <bool kScale, typename T>
SAGE_CLONES void AddRows2(float* acc, const T* g0, float w0, const T* g1, float w1, int64_t n,
                          float s) {
  for (int64_t j = 0; j < n; ++j) {
    float x0 = Load<kScale>(g0[j], s), x1 = Load<kScale>(g1[j], s);
    acc[j] = (acc[j] + x0 * x0 * w0) + x1 * x1 * w1;
  }
}

template <bool kScale, typename T>
SAGE_CLONES void AddRow(float* acc, const T* g0, float w0, int64_t n, float s) {
  for (int64_t j = 0; j < n; ++j) {
    float x0 = Load<kScale>(g0[j], s);
    acc[j] += x0 * x0 * w0;
  }
}

// What one pass over a matrix does (see Matrix::Pass).
struct PassSpec {
  const float* col_weights;  // weights of a row's sum (null: no row sums this pass)
  float row_target, row_eps;  // the row scales' rescale, when there are row sums
  bool row_weight_is_scale;   // the column sums weight row i by (its new scale)^2, else 1
  bool col_sums;              // whether this pass forms column sums
};

// The chunks of a pass are shared with helper threads of this library's own: XLA's intra-op
// pool takes a task scheduled from inside a custom call only once one of its threads looks
// for work, which in a running step is mostly after the call has ended (measured: the
// helpers took under 1% of the chunks).  The helpers spin briefly between passes (the next
// pass follows within microseconds) and then sleep on a condition variable.
class Helpers {
 public:
  struct Job {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> active{0};
    int64_t n = 0;
    int64_t helpers = 0;  // how many helpers may join
    const std::function<void(int64_t)>* fn = nullptr;
  };

  static Helpers& Get() {
    static Helpers* helpers = new Helpers();  // never destroyed: its threads outlive main
    return *helpers;
  }

  // Runs fn(k) for k in [0, n) on the caller and at most `helpers` helper threads.
  void Run(int64_t n, int64_t helpers, const std::function<void(int64_t)>& fn) {
    std::unique_lock<std::mutex> busy(run_, std::try_to_lock);
    if (!busy.owns_lock() || helpers <= 0 || n <= 1) {  // another job runs: do it alone
      for (int64_t k = 0; k < n; ++k) fn(k);
      return;
    }
    while (count_ < helpers) {  // started on first need, never more than ever asked for
      const int64_t index = count_++;
      std::thread([this, index] { Loop(index); }).detach();
    }
    auto job = std::make_shared<Job>();
    job->n = n;
    job->helpers = helpers;
    job->fn = &fn;
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = job;
      generation_.fetch_add(1);
    }
    cv_.notify_all();
    Work(*job);
    // every chunk is claimed: wait for the helpers still running one (a helper counts
    // itself active before it claims, so none can claim after this sees 0)
    while (job->active.load() != 0) std::this_thread::yield();
  }

 private:
  Helpers() = default;

  static void Work(Job& job) {
    for (int64_t k; (k = job.next.fetch_add(1)) < job.n;) (*job.fn)(k);
  }

  void Loop(int64_t index) {
    uint64_t seen = 0;
    for (;;) {
      // spin for about 50 us for the next job, then sleep until one is published
      auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
      while (generation_.load() == seen && std::chrono::steady_clock::now() < until) {
        for (int i = 0; i < 64; ++i) std::atomic_signal_fence(std::memory_order_seq_cst);
      }
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_.load() != seen; });
        seen = generation_.load();
        job = job_;
      }
      if (job == nullptr || index >= job->helpers) continue;
      job->active.fetch_add(1);
      Work(*job);
      job->active.fetch_sub(1);
    }
  }

  int64_t count_ = 0;  // helper threads started (guarded by run_)
  std::mutex run_;  // one job at a time
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::shared_ptr<Job> job_;
};

// Runs fn(chunk) for chunk in [0, n) on the calling thread and helper threads: as many as
// XLA's intra-op pool has threads besides the caller (a user's thread settings hold).
template <typename F>
void ParallelChunks(ffi::ThreadPool& pool, int64_t n, const F& fn) {
  const int64_t wanted = std::min<int64_t>(pool.num_threads() - 1, n - 1);
  if (wanted <= 0) {
    for (int64_t k = 0; k < n; ++k) fn(k);
    return;
  }
  const std::function<void(int64_t)> call = [&fn](int64_t k) { fn(k); };
  Helpers::Get().Run(n, wanted, call);
}

// x s^2 where that is exact (x = 0, or x s^2 a normal float32), else -1.
inline float Folded(float x, float s2) {
  float y = x * s2;
  return x == 0 ? 0.0f : (y >= FLT_MIN && y <= FLT_MAX) ? y : -1.0f;
}

template <typename T>
struct Matrix {
  const T* g;
  int64_t rows, cols;
  float s = 1;               // 1/m
  bool fold = false;         // whether a pass may square G itself (see Pass)
  int64_t chunk_rows;        // from the shape alone: the same chunks on any machine
  int64_t chunks;
  std::vector<float> parts;  // per chunk: its column sums
  std::vector<float> folded; // the column weights times s^2
  int64_t passes = 1;        // passes so far (the range pass was the first)

  Matrix(const T* g_, int64_t rows_, int64_t cols_)
      : g(g_), rows(rows_), cols(cols_),
        chunk_rows(std::max(kChunkRows, (rows_ + kMaxChunks - 1) / kMaxChunks)),
        chunks((rows_ + chunk_rows - 1) / chunk_rows) {
    parts.resize(static_cast<size_t>(chunks) * cols);
    folded.resize(cols);
  }

  // One pass: per row, its sum (spec.col_weights) and new scale row_scale[i], then its
  // share of the column sums; col_sums gets the column sums, added in chunk order.
  //
  // Every product is that of the reference, ((g s)^2) w, bit for bit; where `fold` allows,
  // it is formed as g^2 (w s^2) instead (one multiplication less per entry): the same
  // number whenever g^2, (g s)^2 and w s^2 are normal float32 numbers (exact scalings by a
  // power of two then; `fold` checks the entries once, the weights are checked here).
  //
  // Successive passes run the chunks in opposite orders: a matrix a little larger than the
  // last-level cache then finds the chunks the previous pass touched last still there.
  void Pass(ffi::ThreadPool& pool, const PassSpec& spec, float* row_scale, float* col_sums) {
    const bool reverse = (passes++ % 2) == 1;
    const float s2 = s * s;
    bool fold_rows = fold;
    if (fold && spec.col_weights != nullptr)
      for (int64_t j = 0; j < cols; ++j) {
        folded[j] = Folded(spec.col_weights[j], s2);
        fold_rows = fold_rows && folded[j] >= 0;
      }
    const float* row_weights = fold_rows ? folded.data() : spec.col_weights;
    ParallelChunks(pool, chunks, [&](int64_t claimed) {
      const int64_t k = reverse ? chunks - 1 - claimed : claimed;
      float* part = parts.data() + k * cols;
      if (spec.col_sums) std::fill(part, part + cols, 0.0f);
      const int64_t start = k * chunk_rows, end = std::min(rows, start + chunk_rows);
      for (int64_t i = start; i < end; i += 2) {
        const bool pair = i + 1 < end;
        const T* g0 = g + i * cols;
        const T* g1 = g0 + cols;
        float sum[2] = {0, 0}, w[2] = {1, 1};
        if (spec.col_weights != nullptr) {
          if (pair)
            fold_rows ? RowSums2<false>(g0, g1, cols, s, row_weights, sum)
                      : RowSums2<true>(g0, g1, cols, s, row_weights, sum);
          else
            sum[0] = fold_rows ? RowSum<false>(g0, cols, s, row_weights)
                               : RowSum<true>(g0, cols, s, row_weights);
          for (int p = 0; p < 1 + pair; ++p) {
            float& scale = row_scale[i + p];
            scale = Rescale(scale, sum[p], spec.row_target, spec.row_eps);
            if (spec.row_weight_is_scale) w[p] = scale * scale;
          }
        }
        if (!spec.col_sums) continue;
        const float f0 = fold ? Folded(w[0], s2) : -1, f1 = fold && pair ? Folded(w[1], s2) : -1;
        if (pair && f0 >= 0 && f1 >= 0)
          AddRows2<false>(part, g0, f0, g1, f1, cols, s);
        else if (pair)
          AddRows2<true>(part, g0, w[0], g1, w[1], cols, s);
        else if (f0 >= 0)
          AddRow<false>(part, g0, f0, cols, s);
        else
          AddRow<true>(part, g0, w[0], cols, s);
      }
    });
    if (!spec.col_sums) return;
    std::copy(parts.begin(), parts.begin() + cols, col_sums);
    for (int64_t k = 1; k < chunks; ++k)
      for (int64_t j = 0; j < cols; ++j) col_sums[j] += parts[k * cols + j];
  }
};

// The scales of one matrix: row_scale (rows) and col_scale (cols), as the file's header.
template <typename T>
void MatrixScales(ffi::ThreadPool& pool, const T* g, int64_t rows, int64_t cols,
                  bool rows_in, int64_t iters, float eps, float t_in, float t_out,
                  float* row_scale, float* col_scale) {
  std::fill(row_scale, row_scale + rows, 1.0f);
  std::fill(col_scale, col_scale + cols, 1.0f);
  if (rows == 0 || cols == 0) return;
  Matrix<T> mat(g, rows, cols);
  std::vector<float> largest(mat.chunks), smallest(mat.chunks);
  ParallelChunks(pool, mat.chunks, [&](int64_t k) {
    int64_t start = k * mat.chunk_rows, end = std::min(rows, start + mat.chunk_rows);
    Extremes(g + start * cols, (end - start) * cols, &largest[k], &smallest[k]);
  });
  float a = 0, least = INFINITY;
  for (int64_t k = 0; k < mat.chunks; ++k) {
    a = largest[k] > a || largest[k] != largest[k] ? largest[k] : a;
    least = std::min(least, smallest[k]);
  }
  const float m = Pow2Floor(a);
  mat.s = 1.0f / m;  // exact: m is a power of two within [2^-126, 2^126]
  // G's squares may stand for (G/m)'s: every non-zero g^2 and (g/m)^2 normal and finite
  const float low = std::ldexp(1.0f, -63), high = std::ldexp(1.0f, 63);
  mat.fold = std::isfinite(a) && a < high && least >= low && least * mat.s >= low &&
             a * mat.s < high;
  std::vector<float> w(cols), sums(cols);
  if (!rows_in) {
    // rows = fan-out (r), columns = fan-in (c): one pass per iteration.
    for (int64_t it = 0; it < iters; ++it) {
      for (int64_t j = 0; j < cols; ++j) w[j] = col_scale[j] * col_scale[j];
      PassSpec spec{w.data(), t_in, it == 0 ? eps / m : eps, true, true};
      mat.Pass(pool, spec, row_scale, sums.data());
      for (int64_t j = 0; j < cols; ++j) col_scale[j] = Rescale(col_scale[j], sums[j], t_out, eps);
    }
  } else if (iters > 0) {
    // rows = fan-in (c), columns = fan-out (r): the first half-step's column sums (weights
    // c^2 = 1), then per pass a row's half-step and its share of the next column sums.
    PassSpec first{nullptr, 0, 0, false, true};
    mat.Pass(pool, first, row_scale, sums.data());
    for (int64_t j = 0; j < cols; ++j) col_scale[j] = Rescale(col_scale[j], sums[j], t_in, eps / m);
    for (int64_t it = 0; it < iters; ++it) {
      bool last = it + 1 == iters;
      for (int64_t j = 0; j < cols; ++j) w[j] = col_scale[j] * col_scale[j];
      PassSpec spec{w.data(), t_out, eps, true, !last};
      mat.Pass(pool, spec, row_scale, sums.data());
      if (!last)
        for (int64_t j = 0; j < cols; ++j) col_scale[j] = Rescale(col_scale[j], sums[j], t_in, eps);
    }
  }
  // c carries 1/h, r carries h/m: (c, r) = (fan-in, fan-out) scales.
  const float h = Pow2SqrtFloor(m);
  float* c = rows_in ? row_scale : col_scale;
  float* r = rows_in ? col_scale : row_scale;
  int64_t nc = rows_in ? rows : cols, nr = rows_in ? cols : rows;
  for (int64_t i = 0; i < nc; ++i) c[i] /= h;
  const float hm = m / h;
  for (int64_t i = 0; i < nr; ++i) r[i] /= hm;
}

template <typename T>
ffi::Error AllScales(ffi::ThreadPool& pool, const T* g, int64_t batch, int64_t rows,
                     int64_t cols, bool rows_in, int64_t iters, float eps, float t_in,
                     float t_out, float* row_scales, float* col_scales) {
  for (int64_t b = 0; b < batch; ++b)
    MatrixScales(pool, g + b * rows * cols, rows, cols, rows_in, iters, eps, t_in, t_out,
                 row_scales + b * rows, col_scales + b * cols);
  return ffi::Error::Success();
}

ffi::Error SinkhornScales(ffi::ThreadPool pool, ffi::AnyBuffer g, ffi::Buffer<ffi::F32> params,
                          ffi::Buffer<ffi::S32> iters, ffi::ResultBuffer<ffi::F32> row_scales,
                          ffi::ResultBuffer<ffi::F32> col_scales, int32_t rows_in) {
  auto dims = g.dimensions();
  if (dims.size() != 3)
    return ffi::Error::InvalidArgument("sage_sinkhorn_scales: G must be (batch, rows, cols)");
  if (params.element_count() != 3 || iters.element_count() != 1)
    return ffi::Error::InvalidArgument("sage_sinkhorn_scales: params (eps, t_in, t_out), iters");
  const float* p = params.typed_data();
  const int64_t n_iters = std::max<int32_t>(iters.typed_data()[0], 0);
  float* rs = row_scales->typed_data();
  float* cs = col_scales->typed_data();
  if (g.element_type() == ffi::F32)
    return AllScales(pool, static_cast<const float*>(g.untyped_data()), dims[0], dims[1],
                     dims[2], rows_in != 0, n_iters, p[0], p[1], p[2], rs, cs);
  if (g.element_type() == ffi::BF16)
    return AllScales(pool, static_cast<const uint16_t*>(g.untyped_data()), dims[0], dims[1],
                     dims[2], rows_in != 0, n_iters, p[0], p[1], p[2], rs, cs);
  return ffi::Error::InvalidArgument("sage_sinkhorn_scales: G must be float32 or bfloat16");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SageSinkhornScales, SinkhornScales,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("rows_in"));
