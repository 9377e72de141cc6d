// Fused CPU kernels of a few-row (decode) step: each replaces a chain of small torch operators
// whose per-call cost, not their arithmetic, dominates a step of a few requests. Built and loaded
// by moeinfra/moe/cpu_kernels.py, which says when each runs; every one is tested against the
// torch operators it replaces. Arithmetic is float32 whatever the tensors' dtype (but for
// prefill_attention's bfloat16 pairs, which sum their products in float32); where the torch path
// rounds an intermediate to a half-precision dtype, so does the kernel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * static_cast<float>(b[i]);
  return acc;
}

template <typename T>
inline void axpy(float alpha, const T* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * static_cast<float>(x[i]);
}

// a float rounded to T and back, as torch's T-typed intermediate would be
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// 16 floats in one vector register (two on AVX2): GCC's and Clang's vector extension.
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

template <typename T>
inline f32x16 load16(const T* p) {  // float16: converted one by one
  f32x16 v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
template <>
inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <>
inline f32x16 load16(const c10::BFloat16* p) {  // a bfloat16 is a float's upper half
  u16x16 half;
  std::memcpy(&half, p, sizeof half);
  const u32x16 wide = __builtin_convertvector(half, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

// The sum of a vector's 16 lanes, halving it three times (a scalar loop over the lanes is a chain
// of 16 dependent adds, which cost more than the products for rows of ~1,000 values).
inline float hsum(f32x16 v) {
  const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// The 16 dot products of 4 float rows `x[i]` with 4 rows `w[j]` of n values, into out[i * 4 + j]:
// each value loaded once serves four products (16 vector accumulators), where one dot product at
// a time loads two values per multiply-add and is bound by the loads. Callers with fewer rows
// repeat one (its products are computed and dropped).
template <typename T>
inline void dot_4x4(const float* const x[4], const T* const w[4], int64_t n, float* out) {
  f32x16 acc[4][4] = {};
  const int64_t whole = n - n % 16;
  for (int64_t i = 0; i < whole; i += 16) {
    const f32x16 v0 = load16(w[0] + i), v1 = load16(w[1] + i), v2 = load16(w[2] + i),
                 v3 = load16(w[3] + i);
    for (int r = 0; r < 4; ++r) {
      const f32x16 u = load16(x[r] + i);
      acc[r][0] += u * v0, acc[r][1] += u * v1, acc[r][2] += u * v2, acc[r][3] += u * v3;
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 4; ++c) {
      float tail = 0.f;
      for (int64_t i = whole; i < n; ++i) tail += x[r][i] * static_cast<float>(w[c][i]);
      out[r * 4 + c] = hsum(acc[r][c]) + tail;
    }
}

// dot_4x4 for one x row: out[j] = dot(x, w[j])
template <typename T>
inline void dot_1x4(const float* x, const T* const w[4], int64_t n, float* out) {
  f32x16 acc[4] = {};
  const int64_t whole = n - n % 16;
  for (int64_t i = 0; i < whole; i += 16) {
    const f32x16 u = load16(x + i);
    for (int c = 0; c < 4; ++c) acc[c] += u * load16(w[c] + i);
  }
  for (int c = 0; c < 4; ++c) {
    float tail = 0.f;
    for (int64_t i = whole; i < n; ++i) tail += x[i] * static_cast<float>(w[c][i]);
    out[c] = hsum(acc[c]) + tail;
  }
}

// products[r][j] = dot(x row r, w row j) for `count` x rows (stride x_stride) and `columns` w rows
// (stride w_stride), tiled 4 x 4 by dot_4x4; products has `columns` values per row.
template <typename T>
inline void dot_tiles(const float* x, int64_t x_stride, int64_t count, const T* w,
                      int64_t w_stride, int64_t columns, int64_t n, float* products) {
  float tile[16];
  for (int64_t r = 0; r < count; r += 4) {
    const float* xs[4];
    for (int64_t i = 0; i < 4; ++i) xs[i] = x + std::min(r + i, count - 1) * x_stride;
    for (int64_t c = 0; c < columns; c += 4) {
      const T* ws[4];
      for (int64_t j = 0; j < 4; ++j) ws[j] = w + std::min(c + j, columns - 1) * w_stride;
      if (r + 1 == count)
        dot_1x4(xs[0], ws, n, tile);
      else
        dot_4x4(xs, ws, n, tile);
      for (int64_t i = 0; i < 4 && r + i < count; ++i)
        for (int64_t j = 0; j < 4 && c + j < columns; ++j)
          products[(r + i) * columns + c + j] = tile[i * 4 + j];
    }
  }
}

// Splits n tasks of `task_macs` multiply-adds each into at least 64K-multiply-add chunks: waking
// a thread costs more than a smaller chunk saves.
inline int64_t grain_of(int64_t task_macs) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(task_macs, 1));
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU, got ", t.device());
}

// ---- MLA decode attention over a paged latent cache (absorbed form) ----------------------------

// out[h * out_stride + :width] += sum over l of weights[h * weight_stride + l] * row l (rows read
// through `slots`, or rows 0, 1, ... without them), for `heads` weight rows and rows of `width`
// values: 4 heads x 64 values are held in 16 vector accumulators while the rows stream past (a
// row's 4 vectors serve 16 multiply-adds).
template <typename C>
void weighted_rows(const float* weights, int64_t weight_stride, int64_t heads, const C* store,
                   int64_t row_stride, const int64_t* slots, int64_t length, int64_t width,
                   float* out, int64_t out_stride) {
  constexpr int64_t kChunk = 64;
  const int64_t chunks = width / kChunk;
  for (int64_t h = 0; h < heads; h += 4) {
    const float* w[4];
    for (int64_t i = 0; i < 4; ++i) w[i] = weights + std::min(h + i, heads - 1) * weight_stride;
    for (int64_t c = 0; c < chunks; ++c) {
      f32x16 acc[4][4] = {};
      for (int64_t l = 0; l < length; ++l) {
        const C* row = store + (slots ? slots[l] : l) * row_stride + c * kChunk;
        const f32x16 r0 = load16(row), r1 = load16(row + 16), r2 = load16(row + 32),
                     r3 = load16(row + 48);
        for (int i = 0; i < 4; ++i) {
          const float p = w[i][l];
          acc[i][0] += p * r0, acc[i][1] += p * r1, acc[i][2] += p * r2, acc[i][3] += p * r3;
        }
      }
      for (int64_t i = 0; i < 4 && h + i < heads; ++i) {
        float* o = out + (h + i) * out_stride + c * kChunk;
        for (int k = 0; k < 4; ++k)
          for (int e = 0; e < 16; ++e) o[k * 16 + e] += acc[i][k][e];
      }
    }
    int64_t e = chunks * kChunk;
    for (; e + 32 <= width; e += 32) {  // what is left in pairs of vectors (value heads of 32)
      f32x16 acc[4][2] = {};
      for (int64_t l = 0; l < length; ++l) {
        const C* row = store + (slots ? slots[l] : l) * row_stride + e;
        const f32x16 r0 = load16(row), r1 = load16(row + 16);
        for (int i = 0; i < 4; ++i) acc[i][0] += w[i][l] * r0, acc[i][1] += w[i][l] * r1;
      }
      for (int64_t i = 0; i < 4 && h + i < heads; ++i)
        for (int k = 0; k < 16; ++k)
          out[(h + i) * out_stride + e + k] += acc[i][0][k],
              out[(h + i) * out_stride + e + 16 + k] += acc[i][1][k];
    }
    for (; e + 16 <= width; e += 16) {  // then single vectors
      f32x16 acc[4] = {};
      for (int64_t l = 0; l < length; ++l) {
        const f32x16 r = load16(store + (slots ? slots[l] : l) * row_stride + e);
        for (int i = 0; i < 4; ++i) acc[i] += w[i][l] * r;
      }
      for (int64_t i = 0; i < 4 && h + i < heads; ++i)
        for (int k = 0; k < 16; ++k) out[(h + i) * out_stride + e + k] += acc[i][k];
    }
    for (; e < width; ++e)  // then one by one
      for (int64_t i = 0; i < 4 && h + i < heads; ++i)
        for (int64_t l = 0; l < length; ++l)
          out[(h + i) * out_stride + e] +=
              w[i][l] * static_cast<float>(store[(slots ? slots[l] : l) * row_stride + e]);
  }
}

// exp of 16 values of at most 0 (softmax's shifted scores): 2^n * e^r with |r| <= ln 2 / 2 and a
// degree-6 polynomial for e^r, within 2 ulp of std::exp; values below -87 give ~1e-38, not 0.
inline f32x16 exp16(f32x16 x) {
  typedef int32_t i32x16 __attribute__((vector_size(64)));
  x = x < -87.f ? f32x16{} - 87.f : x;
  const f32x16 rounder = f32x16{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const f32x16 n = (x * 1.44269504f + rounder) - rounder;
  const f32x16 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  f32x16 p = f32x16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// values[i] = exp(values[i] - shift) for n values; returns their sum
inline float exp_shifted(float* values, int64_t n, float shift) {
  f32x16 total = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const f32x16 e = exp16(load16(values + i) - shift);
    std::memcpy(values + i, &e, sizeof e);
    total += e;
  }
  float sum = hsum(total);
  for (; i < n; ++i) sum += (values[i] = std::exp(values[i] - shift));
  return sum;
}

// out[r][h] = x[r][h] . w[h] ([R, H, n] by [H, n, m] -> [R, H, m]): per head, the weighted sum of
// its n rows of m values; tasks are (head, block of 16 requests).
void per_head_products(const float* x, const float* w, float* out, int64_t requests,
                       int64_t heads, int64_t n, int64_t m) {
  constexpr int64_t kRequests = 16;
  const int64_t blocks = (requests + kRequests - 1) / kRequests;
  at::parallel_for(0, heads * blocks, grain_of(kRequests * n * m), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / blocks, r0 = task % blocks * kRequests;
      const int64_t count = std::min(kRequests, requests - r0);
      float* o = out + (r0 * heads + h) * m;
      for (int64_t r = 0; r < count; ++r) std::fill_n(o + r * heads * m, m, 0.f);
      weighted_rows(x + (r0 * heads + h) * n, heads * n, count, w + h * n * m, m,
                    static_cast<const int64_t*>(nullptr), n, m, o, heads * m);
    }
  });
}

// Cached rows a task reads per pass: their scores and their weighted sum share one stay in the L2
// cache (64 DeepSeek-V3-wide float32 rows are 147 KB), where a whole context's scores first and
// its weighted sum after read every row from memory twice.
constexpr int64_t kDecodeRows = 64;

// Attention of each query head over its request's cached rows in the cache's space: latent[r][h]
// = softmax(scale * query[r][h] . rows) . rows[:, :rank], with query = [q_latent, q_pe]. Tasks are
// (request, group of heads); a request's heads are split in groups only to keep every thread busy.
// Rows are taken kDecodeRows at a time with a running softmax (flash decoding): each block's
// weights are exp(score - the largest score so far), and what was summed before a larger score
// arrives is scaled down by exp(old largest - new largest).
template <typename C>
void mla_decode_kernel(const float* q_latent, const float* q_pe, const C* store,
                       int64_t row_stride, const int64_t* slots, const int64_t* lengths,
                       float* latent, int64_t requests, int64_t heads, int64_t rope, int64_t rank,
                       int64_t context, float scale) {
  const int64_t width = rank + rope, threads = at::get_num_threads();
  const int64_t wanted = std::clamp<int64_t>((2 * threads + requests - 1) / requests, 1, heads);
  const int64_t per_group = (heads + wanted - 1) / wanted;
  const int64_t groups = (heads + per_group - 1) / per_group;  // none empty
  const int64_t task_macs = per_group * context * (width + rank);
  at::parallel_for(0, requests * groups, grain_of(task_macs), [&](int64_t begin, int64_t end) {
    std::vector<float> query(per_group * width), scores(per_group * kDecodeRows),
        largest(per_group), total(per_group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / groups, h0 = task % groups * per_group;
      const int64_t hn = std::min(heads, h0 + per_group) - h0, length = lengths[r];
      const int64_t* context_slots = slots + r * context;
      float* out = latent + (r * heads + h0) * rank;
      for (int64_t h = 0; h < hn; ++h) {
        const int64_t head = h0 + h;
        std::copy_n(q_latent + (r * heads + head) * rank, rank, query.data() + h * width);
        std::copy_n(q_pe + (r * heads + head) * rope, rope, query.data() + h * width + rank);
      }
      std::fill(out, out + hn * rank, 0.f);
      std::fill(largest.begin(), largest.end(), -std::numeric_limits<float>::infinity());
      std::fill(total.begin(), total.end(), 0.f);
      float tile[16];
      for (int64_t l0 = 0; l0 < length; l0 += kDecodeRows) {
        const int64_t n = std::min(kDecodeRows, length - l0);
        const int64_t* block = context_slots + l0;
        // scores of 4 heads x 4 cached rows at a time (dot_4x4), each row read in place
        for (int64_t l = 0; l < n; l += 4) {
          const C* rows[4];
          for (int64_t j = 0; j < 4; ++j)
            rows[j] = store + block[std::min(l + j, n - 1)] * row_stride;
          for (int64_t h = 0; h < hn; h += 4) {
            const float* qs[4];
            for (int64_t i = 0; i < 4; ++i) qs[i] = query.data() + std::min(h + i, hn - 1) * width;
            dot_4x4(qs, rows, width, tile);
            for (int64_t i = 0; i < 4 && h + i < hn; ++i)
              for (int64_t j = 0; j < 4 && l + j < n; ++j)
                scores[(h + i) * kDecodeRows + l + j] = tile[i * 4 + j] * scale;
          }
        }
        for (int64_t h = 0; h < hn; ++h) {
          float* head_scores = scores.data() + h * kDecodeRows;
          const float top = std::max(largest[h], *std::max_element(head_scores, head_scores + n));
          if (top > largest[h] && total[h] > 0.f) {
            const float shrink = std::exp(largest[h] - top);
            total[h] *= shrink;
            for (int64_t k = 0; k < rank; ++k) out[h * rank + k] *= shrink;
          }
          largest[h] = top;
          total[h] += exp_shifted(head_scores, n, top);
        }
        weighted_rows(scores.data(), kDecodeRows, hn, store, row_stride, block, n, rank, out, rank);
      }
      for (int64_t h = 0; h < hn; ++h)
        for (int64_t k = 0; k < rank; ++k) out[h * rank + k] /= total[h];
    }
  });
}

at::Tensor mla_decode(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& w_uk,
                      const at::Tensor& w_uv_t, const at::Tensor& store, const at::Tensor& slots,
                      const at::Tensor& lengths, double scale, at::ScalarType out_dtype) {
  for (auto* t : {&q_nope, &q_pe, &w_uk, &w_uv_t, &store, &slots, &lengths})
    check_cpu(*t, "mla_decode's tensors");
  TORCH_CHECK(
      q_nope.dim() == 3 && q_pe.dim() == 3 && w_uk.dim() == 3 && w_uv_t.dim() == 3,
      "mla_decode: q_nope, q_pe [S, heads, d], w_uk [heads, nope, rank], w_uv_t [heads, rank, v]");
  TORCH_CHECK(store.dim() == 2 && store.stride(1) == 1,
              "mla_decode: store [slots, width] with rows contiguous");
  TORCH_CHECK(slots.dim() == 2 && lengths.dim() == 1 && slots.size(0) == lengths.size(0) &&
                  slots.size(0) == q_nope.size(0),
              "mla_decode: slots [S, L], lengths [S], one query per request");
  const int64_t requests = q_nope.size(0), heads = q_nope.size(1), nope = q_nope.size(2);
  const int64_t rope = q_pe.size(2), rank = w_uk.size(2), value = w_uv_t.size(2);
  TORCH_CHECK(store.size(1) >= rank + rope, "mla_decode: store rows narrower than rank + rope");
  TORCH_CHECK(w_uk.scalar_type() == at::kFloat && w_uv_t.scalar_type() == at::kFloat,
              "mla_decode: float32 absorbed weights");
  TORCH_CHECK(q_pe.size(0) == requests && q_pe.size(1) == heads && w_uk.size(0) == heads &&
                  w_uk.size(1) == nope && w_uv_t.size(0) == heads && w_uv_t.size(1) == rank,
              "mla_decode: q_nope, q_pe, w_uk and w_uv_t disagree on heads or widths");
  if (requests == 0 || heads == 0)
    return at::empty({requests, heads, value}, q_nope.options().dtype(out_dtype));
  auto sl = slots.to(at::kLong).contiguous(), len = lengths.to(at::kLong).contiguous();
  const int64_t context = sl.size(1), cached = store.size(0);
  const int64_t* lp = len.data_ptr<int64_t>();
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t r = 0; r < requests; ++r) {
    TORCH_CHECK(lp[r] >= 1 && lp[r] <= context, "mla_decode: lengths must lie in [1, ", context,
                "], got ", lp[r]);
    for (int64_t l = 0; l < lp[r]; ++l)
      TORCH_CHECK(sp[r * context + l] >= 0 && sp[r * context + l] < cached,
                  "mla_decode: a slot outside the store's ", cached, " rows");
  }
  auto qn = q_nope.to(at::kFloat).contiguous(), qp = q_pe.to(at::kFloat).contiguous();
  auto wk = w_uk.contiguous(), wv = w_uv_t.contiguous();
  const auto f32 = q_nope.options().dtype(at::kFloat);
  auto q_latent = at::empty({requests, heads, rank}, f32), latent = at::empty_like(q_latent);
  auto out = at::empty({requests, heads, value}, f32);
  per_head_products(qn.data_ptr<float>(), wk.data_ptr<float>(), q_latent.data_ptr<float>(),
                    requests, heads, nope, rank);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, store.scalar_type(), "mla_decode", [&] {
    mla_decode_kernel<scalar_t>(q_latent.data_ptr<float>(), qp.data_ptr<float>(),
                                store.data_ptr<scalar_t>(), store.stride(0), sp, lp,
                                latent.data_ptr<float>(), requests, heads, rope, rank, context,
                                static_cast<float>(scale));
  });
  per_head_products(latent.data_ptr<float>(), wv.data_ptr<float>(), out.data_ptr<float>(),
                    requests, heads, rank, value);
  return out_dtype == at::kFloat ? out : out.to(out_dtype);
}

// ---- causal attention of a prompt chunk over per-head keys and values ---------------------------

// Query i of a chunk of n (the context's last n positions) attends to keys 0 .. m - n + i. Tasks
// are (head, block of 64 queries); key blocks of 64 stream past with a running softmax (flash
// attention): no n x m score matrix is written, the blocks above the diagonal are not computed.
// Each head's keys are transposed once, before the tasks, into [dq][keys padded to 64s].
// scores[i * 64 + j] = query row i . key j for qn <= 64 float query rows of dq values and the 64
// keys from `keys_t` (transposed: one row of key_stride values per dimension), 4 queries x 64 keys
// in 16 vector accumulators, one multiply-add per query value and key vector (no horizontal sums:
// a dot product of 64 values at a time spends as long summing its vectors' lanes as multiplying).
inline void query_key_block(const float* query, int64_t qn, const float* keys_t, int64_t key_stride,
                            int64_t dq, float* scores) {
  for (int64_t i = 0; i < qn; i += 4) {
    const float* q[4];
    for (int64_t r = 0; r < 4; ++r) q[r] = query + std::min(i + r, qn - 1) * dq;
    f32x16 acc[4][4] = {};
    for (int64_t d = 0; d < dq; ++d) {
      const float* kt = keys_t + d * key_stride;
      const f32x16 k0 = load16(kt), k1 = load16(kt + 16), k2 = load16(kt + 32), k3 = load16(kt + 48);
      for (int r = 0; r < 4; ++r) {
        const float x = q[r][d];
        acc[r][0] += x * k0, acc[r][1] += x * k1, acc[r][2] += x * k2, acc[r][3] += x * k3;
      }
    }
    for (int64_t r = 0; r < 4 && i + r < qn; ++r)
      std::memcpy(scores + (i + r) * 64, acc[r], sizeof acc[r]);
  }
}

// The largest of n values, 16 lanes at a time.
inline float largest_of(const float* values, int64_t n) {
  f32x16 top = f32x16{} - std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const f32x16 v = load16(values + i);
    top = v > top ? v : top;
  }
  float out = -std::numeric_limits<float>::infinity();
  for (int e = 0; e < 16; ++e) out = std::max(out, top[e]);
  for (; i < n; ++i) out = std::max(out, values[i]);
  return out;
}

// One block of scores [qn, 64] (kn keys) into probabilities of the running softmax: query i sees
// keys j <= i + diagonal of the block (masked ones become 0), scaled by `scale`; where a query's
// largest score grows, its total and its accumulated values `acc` [qn, dv] shrink to match.
inline void softmax_block(float* scores, int64_t qn, int64_t kn, int64_t diagonal, float scale,
                          float* largest, float* total, float* acc, int64_t dv) {
  constexpr int64_t kBlock = 64;
  for (int64_t i = 0; i < qn; ++i) {
    float* row = scores + i * kBlock;
    const int64_t seen = std::min(kn, diagonal + i + 1);  // keys this query sees
    if (seen <= 0) {
      std::fill(row, row + kn, 0.f);
      continue;
    }
    for (int64_t j = 0; j < seen; ++j) row[j] *= scale;
    std::fill(row + seen, row + kn, 0.f);
    const float top = std::max(largest[i], largest_of(row, seen));
    if (top > largest[i] && total[i] > 0.f) {
      const float shrink = std::exp(largest[i] - top);
      total[i] *= shrink;
      for (int64_t d = 0; d < dv; ++d) acc[i * dv + d] *= shrink;
    }
    largest[i] = top;
    total[i] += exp_shifted(row, seen, top);
  }
}

template <typename T>
void prefill_attention_kernel(const T* q, const int64_t* q_strides, const T* k,
                              const int64_t* k_strides, const T* v, const int64_t* v_strides,
                              T* out, int64_t n, int64_t m, int64_t heads, int64_t dq, int64_t dv,
                              float scale) {
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (n + kBlock - 1) / kBlock, offset = m - n;
  const int64_t padded = (m + kBlock - 1) / kBlock * kBlock;
  std::vector<float> keys_t(heads * dq * padded, 0.f);  // [heads][dq][padded]
  at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h)
      for (int64_t j = 0; j < m; ++j)
        for (int64_t d = 0; d < dq; ++d)
          keys_t[(h * dq + d) * padded + j] = static_cast<float>(k[j * k_strides[0] + h * k_strides[1] + d]);
  });
  at::parallel_for(0, heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(kBlock * dq), scores(kBlock * kBlock), acc(kBlock * dv),
        largest(kBlock), total(kBlock);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / blocks, q0 = task % blocks * kBlock;
      const int64_t qn = std::min(kBlock, n - q0);
      for (int64_t i = 0; i < qn; ++i)
        for (int64_t d = 0; d < dq; ++d)
          query[i * dq + d] = static_cast<float>(q[(q0 + i) * q_strides[0] + h * q_strides[1] + d]);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(largest.begin(), largest.end(), -std::numeric_limits<float>::infinity());
      std::fill(total.begin(), total.end(), 0.f);
      const int64_t keys = offset + q0 + qn;  // the last query's keys
      for (int64_t k0 = 0; k0 < keys; k0 += kBlock) {
        const int64_t kn = std::min(kBlock, keys - k0);
        query_key_block(query.data(), qn, keys_t.data() + h * dq * padded + k0, padded, dq,
                        scores.data());
        softmax_block(scores.data(), qn, kn, offset + q0 - k0, scale, largest.data(), total.data(),
                      acc.data(), dv);
        weighted_rows(scores.data(), kBlock, qn, v + k0 * v_strides[0] + h * v_strides[1],
                      v_strides[0], static_cast<const int64_t*>(nullptr), kn, dv, acc.data(), dv);
      }
      for (int64_t i = 0; i < qn; ++i) {
        T* o = out + ((q0 + i) * heads + h) * dv;
        for (int64_t d = 0; d < dv; ++d) o[d] = static_cast<T>(acc[i * dv + d] / total[i]);
      }
    }
  });
}

#if defined(__AVX512BF16__)
// The same attention for bfloat16 on AVX512-BF16: vdpbf16ps multiplies 16 pairs of bfloat16 and
// adds both products to 16 floats, twice a float32 multiply-add's work per instruction and nothing
// widened. A pair is one 32-bit lane: keys are packed once per head as pairs of adjacent
// dimensions [dq / 2][keys], values as pairs of adjacent keys [keys / 2][dv], and each block's
// probabilities are rounded to bfloat16 pairs before the value product (as torch's bfloat16
// attention rounds them).

// row[d] and row[d + 1] as one lane (0 past `width`)
inline uint32_t pair_of(const c10::BFloat16* row, int64_t d, int64_t width) {
  const uint32_t lo = d < width ? row[d].x : 0, hi = d + 1 < width ? row[d + 1].x : 0;
  return lo | hi << 16;
}

inline __m512 dot_pairs(__m512 acc, uint32_t pair, __m512i lanes) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(pair), (__m512bh)lanes);
}

// scores[i * 64 + j] = query i . key j for qn query rows of `pairs` lanes and the 64 keys whose
// lanes start at `keys` (one row of `key_stride` lanes per pair): 4 queries x 64 keys at a time.
inline void query_key_pairs(const uint32_t* query, int64_t qn, const uint32_t* keys,
                            int64_t key_stride, int64_t pairs, float* scores) {
  for (int64_t i = 0; i < qn; i += 4) {
    const uint32_t* q[4];
    for (int64_t r = 0; r < 4; ++r) q[r] = query + std::min(i + r, qn - 1) * pairs;
    __m512 acc[4][4];
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      const uint32_t* kp = keys + p * key_stride;
      const __m512i k0 = _mm512_loadu_si512(kp), k1 = _mm512_loadu_si512(kp + 16),
                    k2 = _mm512_loadu_si512(kp + 32), k3 = _mm512_loadu_si512(kp + 48);
      for (int r = 0; r < 4; ++r) {
        acc[r][0] = dot_pairs(acc[r][0], q[r][p], k0);
        acc[r][1] = dot_pairs(acc[r][1], q[r][p], k1);
        acc[r][2] = dot_pairs(acc[r][2], q[r][p], k2);
        acc[r][3] = dot_pairs(acc[r][3], q[r][p], k3);
      }
    }
    for (int64_t r = 0; r < 4 && i + r < qn; ++r)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(scores + (i + r) * 64 + c * 16, acc[r][c]);
  }
}

// acc[i][:width] += probabilities of query i (32 lanes at probs + i * 32) . the `pairs` lane rows
// of values (stride value_stride) for ROWS queries x NV * 16 values at a time: 16 accumulators,
// enough independent sums to hide the instruction's latency.
template <int ROWS, int NV>
inline void value_pairs(const uint32_t* probs, int64_t qn, const uint32_t* values,
                        int64_t value_stride, int64_t pairs, float* acc, int64_t acc_stride,
                        int64_t width) {
  for (int64_t i = 0; i < qn; i += ROWS) {
    const uint32_t* w[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) w[r] = probs + std::min(i + r, qn - 1) * 32;
    __m512 sum[ROWS][NV];
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) sum[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      __m512i v[NV];
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) v[c] = _mm512_loadu_si512(values + p * value_stride + c * 16);
#pragma GCC unroll 16
      for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < NV; ++c) sum[r][c] = dot_pairs(sum[r][c], w[r][p], v[c]);
    }
    for (int64_t r = 0; r < ROWS && i + r < qn; ++r) {
      float lanes[NV * 16];
      for (int c = 0; c < NV; ++c) _mm512_storeu_ps(lanes + c * 16, sum[r][c]);
      float* o = acc + (i + r) * acc_stride;
      for (int64_t e = 0; e < std::min<int64_t>(width, NV * 16); ++e) o[e] += lanes[e];
    }
  }
}

void prefill_attention_pairs(const c10::BFloat16* q, const int64_t* q_strides,
                             const c10::BFloat16* k, const int64_t* k_strides,
                             const c10::BFloat16* v, const int64_t* v_strides, c10::BFloat16* out,
                             int64_t n, int64_t m, int64_t heads, int64_t dq, int64_t dv,
                             float scale) {
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (n + kBlock - 1) / kBlock, offset = m - n;
  const int64_t pairs = (dq + 1) / 2, padded = (m + kBlock - 1) / kBlock * kBlock;
  const int64_t value_stride = (dv + 15) / 16 * 16;
  // keys [heads][pairs][padded], values [heads][padded / 2][value_stride]; 0 where padded
  std::vector<uint32_t> keys(heads * pairs * padded, 0), values(heads * padded / 2 * value_stride, 0);
  at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      uint32_t* kh = keys.data() + h * pairs * padded;
      for (int64_t j = 0; j < m; ++j) {
        const c10::BFloat16* row = k + j * k_strides[0] + h * k_strides[1];
        for (int64_t p = 0; p < pairs; ++p) kh[p * padded + j] = pair_of(row, 2 * p, dq);
      }
      uint32_t* vh = values.data() + h * padded / 2 * value_stride;
      for (int64_t j = 0; j < m; ++j) {
        const c10::BFloat16* row = v + j * v_strides[0] + h * v_strides[1];
        const int shift = j % 2 * 16;
        for (int64_t d = 0; d < dv; ++d)
          vh[j / 2 * value_stride + d] |= static_cast<uint32_t>(row[d].x) << shift;
      }
    }
  });
  at::parallel_for(0, heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> query(kBlock * pairs), probs(kBlock * kBlock / 2);
    std::vector<float> scores(kBlock * kBlock), acc(kBlock * dv), largest(kBlock), total(kBlock);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / blocks, q0 = task % blocks * kBlock;
      const int64_t qn = std::min(kBlock, n - q0);
      for (int64_t i = 0; i < qn; ++i)
        for (int64_t p = 0; p < pairs; ++p)
          query[i * pairs + p] = pair_of(q + (q0 + i) * q_strides[0] + h * q_strides[1], 2 * p, dq);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(largest.begin(), largest.end(), -std::numeric_limits<float>::infinity());
      std::fill(total.begin(), total.end(), 0.f);
      const uint32_t* kh = keys.data() + h * pairs * padded;
      const uint32_t* vh = values.data() + h * padded / 2 * value_stride;
      const int64_t last = offset + q0 + qn;  // the last query's keys
      for (int64_t k0 = 0; k0 < last; k0 += kBlock) {
        const int64_t kn = std::min(kBlock, last - k0);
        query_key_pairs(query.data(), qn, kh + k0, padded, pairs, scores.data());
        softmax_block(scores.data(), qn, kn, offset + q0 - k0, scale, largest.data(), total.data(),
                      acc.data(), dv);
        for (int64_t i = 0; i < qn; ++i) {  // keys past kn are real keys of no query here
          float* row = scores.data() + i * kBlock;
          std::fill(row + kn, row + kBlock, 0.f);
          for (int c = 0; c < 2; ++c)
            _mm512_storeu_si512(probs.data() + i * 32 + c * 16,
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + c * 32 + 16),
                                                             _mm512_loadu_ps(row + c * 32)));
        }
        const int64_t key_pairs = (kn + 1) / 2;
        const uint32_t* vk = vh + k0 / 2 * value_stride;
        const uint32_t* pp = probs.data();
        int64_t c0 = 0;
        for (; c0 + 64 <= value_stride; c0 += 64)
          value_pairs<4, 4>(pp, qn, vk + c0, value_stride, key_pairs, acc.data() + c0, dv, dv - c0);
        if (c0 + 32 <= value_stride) {
          value_pairs<8, 2>(pp, qn, vk + c0, value_stride, key_pairs, acc.data() + c0, dv, dv - c0);
          c0 += 32;
        }
        if (c0 < value_stride)
          value_pairs<16, 1>(pp, qn, vk + c0, value_stride, key_pairs, acc.data() + c0, dv, dv - c0);
      }
      for (int64_t i = 0; i < qn; ++i) {
        c10::BFloat16* o = out + ((q0 + i) * heads + h) * dv;
        for (int64_t d = 0; d < dv; ++d) o[d] = static_cast<c10::BFloat16>(acc[i * dv + d] / total[i]);
      }
    }
  });
}
#endif

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             double scale, bool bf16_pairs) {
  for (auto* t : {&q, &k, &v}) check_cpu(*t, "prefill_attention's tensors");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.stride(2) == 1 &&
                  k.stride(2) == 1 && v.stride(2) == 1,
              "prefill_attention: q [n, heads, d], k [m, heads, d], v [m, heads, dv], each row's "
              "values contiguous");
  const int64_t n = q.size(0), heads = q.size(1), dq = q.size(2), m = k.size(0), dv = v.size(2);
  TORCH_CHECK(k.size(1) == heads && v.size(1) == heads && k.size(2) == dq && v.size(0) == m &&
                  n <= m && m > 0,
              "prefill_attention: q, k and v disagree on heads or widths, or more queries than keys");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "prefill_attention: q, k and v of one dtype");
  auto out = at::empty({n, heads, dv}, q.options());
  if (n == 0) return out;
  const int64_t qs[2] = {q.stride(0), q.stride(1)}, ks[2] = {k.stride(0), k.stride(1)},
                vs[2] = {v.stride(0), v.stride(1)};
#if defined(__AVX512BF16__)
  if (bf16_pairs && q.scalar_type() == at::kBFloat16) {
    prefill_attention_pairs(q.data_ptr<c10::BFloat16>(), qs, k.data_ptr<c10::BFloat16>(), ks,
                            v.data_ptr<c10::BFloat16>(), vs, out.data_ptr<c10::BFloat16>(), n, m,
                            heads, dq, dv, static_cast<float>(scale));
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "prefill_attention", [&] {
    prefill_attention_kernel<scalar_t>(q.data_ptr<scalar_t>(), qs, k.data_ptr<scalar_t>(), ks,
                                       v.data_ptr<scalar_t>(), vs, out.data_ptr<scalar_t>(), n, m,
                                       heads, dq, dv, static_cast<float>(scale));
  });
  return out;
}

// ---- RMSNorm ------------------------------------------------------------------------------------

template <typename T>
void rms_norm_kernel(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, grain_of(4 * dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * dim;
      T* o = out + r * dim;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < dim; ++i)
        squares += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      const float inv = 1.f / std::sqrt(squares / dim + eps);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i)
        o[i] = static_cast<T>(static_cast<float>(xr[i]) * inv * static_cast<float>(w[i]));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_cpu(x, "rms_norm's x");
  check_cpu(weight, "rms_norm's weight");
  TORCH_CHECK(
      weight.dim() == 1 && x.size(-1) == weight.size(0) && x.scalar_type() == weight.scalar_type(),
      "rms_norm: weight [dim] of x's dtype");
  auto xc = x.contiguous(), wc = weight.contiguous();
  auto out = at::empty_like(xc);
  const int64_t dim = x.size(-1), rows = dim ? xc.numel() / dim : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel<scalar_t>(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(),
                              out.data_ptr<scalar_t>(), rows, dim, static_cast<float>(eps));
  });
  return out;
}

// ---- routed experts of a few rows, each row with its own slot's weights -------------------------

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

// Rows of one slot that follow each other form a run; a task is (run, block of 64 output columns):
// each weight row is read once per run, for all of the run's rows. With `combine` ([T, k] gate
// weights), the n = T * k rows are routed pairs, pair p reads row p / k and the output is each
// token's weighted sum over its k pairs, rounded as torch's combine_pairs (a bmm with the weights
// cast to T) rounds it.
template <typename T>
void expert_rows_kernel(const T* rows, const int64_t* slots, const T* w13, const T* w2, T* out,
                        int64_t n, int64_t hidden, int64_t inter, float limit, bool limited,
                        const float* combine, int64_t top_k) {
  const int64_t per_row = combine ? top_k : 1;
  std::vector<int64_t> starts;
  for (int64_t r = 0; r < n; ++r)
    if (r == 0 || slots[r] != slots[r - 1]) starts.push_back(r);
  starts.push_back(n);
  const int64_t runs = static_cast<int64_t>(starts.size()) - 1, block = 64;
  std::vector<float> act(n * inter);
  // gate and up projections, then SwiGLU
  const int64_t blocks = (inter + block - 1) / block;
  at::parallel_for(0, runs * blocks, grain_of(2 * block * hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> x, gates, ups;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t run = task / blocks, first = task % blocks * block;
      const int64_t r0 = starts[run], count = starts[run + 1] - r0,
                    last = std::min(inter, first + block);
      x.resize(count * hidden);
      for (int64_t r = 0; r < count; ++r) {
        const T* source = rows + (r0 + r) / per_row * hidden;
        for (int64_t i = 0; i < hidden; ++i) x[r * hidden + i] = static_cast<float>(source[i]);
      }
      const T* w = w13 + slots[r0] * 2 * inter * hidden;
      const int64_t columns = last - first;
      gates.resize(count * columns);
      ups.resize(count * columns);
      dot_tiles(x.data(), hidden, count, w + first * hidden, hidden, columns, hidden, gates.data());
      dot_tiles(x.data(), hidden, count, w + (inter + first) * hidden, hidden, columns, hidden,
                ups.data());
      for (int64_t j = first; j < last; ++j) {
        for (int64_t r = 0; r < count; ++r) {
          float gate = round_to<T>(gates[r * columns + j - first]);
          float up = round_to<T>(ups[r * columns + j - first]);
          if (limited) {
            gate = std::min(gate, limit);
            up = std::clamp(up, -limit, limit);
          }
          act[(r0 + r) * inter + j] = round_to<T>(round_to<T>(silu(gate)) * up);
        }
      }
    }
  });
  // down projection
  const int64_t out_blocks = (hidden + block - 1) / block;
  if (combine) {  // tasks: (token, block of 64 output columns)
    const int64_t tokens = n / top_k;
    at::parallel_for(
        0, tokens * out_blocks, grain_of(block * inter * top_k), [&](int64_t begin, int64_t end) {
          for (int64_t task = begin; task < end; ++task) {
            const int64_t t = task / out_blocks, first = task % out_blocks * block;
            const int64_t last = std::min(hidden, first + block);
            for (int64_t k = first; k < last; ++k) {
              float total = 0.f;
              for (int64_t j = 0; j < top_k; ++j) {
                const int64_t p = t * top_k + j;
                const T* w = w2 + slots[p] * hidden * inter + k * inter;
                total +=
                    round_to<T>(combine[p]) * round_to<T>(dot(act.data() + p * inter, w, inter));
              }
              out[t * hidden + k] = static_cast<T>(total);
            }
          }
        });
    return;
  }
  at::parallel_for(0, runs * out_blocks, grain_of(block * inter), [&](int64_t begin, int64_t end) {
    std::vector<float> products;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t run = task / out_blocks, first = task % out_blocks * block;
      const int64_t r0 = starts[run], count = starts[run + 1] - r0,
                    last = std::min(hidden, first + block);
      const T* w = w2 + slots[r0] * hidden * inter;
      const int64_t columns = last - first;
      products.resize(count * columns);
      dot_tiles(act.data() + r0 * inter, inter, count, w + first * inter, inter, columns, inter,
                products.data());
      for (int64_t r = 0; r < count; ++r)
        for (int64_t k = first; k < last; ++k)
          out[(r0 + r) * hidden + k] = static_cast<T>(products[r * columns + k - first]);
    }
  });
}

at::Tensor expert_rows(const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& w13,
                       const at::Tensor& w2, std::optional<double> limit,
                       const std::optional<at::Tensor>& combine) {
  for (auto* t : {&rows, &slots, &w13, &w2}) check_cpu(*t, "expert_rows' tensors");
  at::Tensor c;
  int64_t top_k = 1;
  if (combine.has_value()) {
    check_cpu(*combine, "expert_rows' combine weights");
    TORCH_CHECK(combine->dim() == 2 && combine->size(0) == rows.size(0),
                "expert_rows: combine weights [T, k] for rows [T, H]");
    c = combine->to(at::kFloat).contiguous();
    top_k = c.size(1);
  }
  TORCH_CHECK(rows.dim() == 2 && slots.dim() == 1 && slots.size(0) == rows.size(0) * top_k,
              "expert_rows: rows [N, H] and slots [N], or [T * k] with combine weights [T, k]");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(2) == rows.size(1) &&
                  w2.size(1) == rows.size(1) && w13.size(1) == 2 * w2.size(2) &&
                  w13.size(0) == w2.size(0),
              "expert_rows: w13 [slots, 2I, H], w2 [slots, H, I]");
  TORCH_CHECK(w13.scalar_type() == w2.scalar_type() && w13.scalar_type() == rows.scalar_type(),
              "expert_rows: weights of the rows' dtype");
  auto x = rows.contiguous(), s = slots.to(at::kLong).contiguous();
  auto a = w13.contiguous(), b = w2.contiguous();
  auto out = at::empty_like(x);
  const int64_t n = s.size(0), hidden = x.size(1), inter = w2.size(2);
  if (n == 0) return out.zero_();
  const int64_t* sp = s.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(sp[r] >= 0 && sp[r] < w13.size(0), "expert_rows: slot ", sp[r], " outside the ",
                w13.size(0), " slots");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "expert_rows", [&] {
    expert_rows_kernel<scalar_t>(x.data_ptr<scalar_t>(), s.data_ptr<int64_t>(),
                                 a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(),
                                 out.data_ptr<scalar_t>(), n, hidden, inter,
                                 static_cast<float>(limit.value_or(0.)), limit.has_value(),
                                 c.defined() ? c.data_ptr<float>() : nullptr, top_k);
  });
  return out;
}

// ---- rotary embedding, DeepSeek's interleaved layout ------------------------------------------

template <typename T>
void rope_kernel(const T* x, const float* cis, T* out, int64_t tokens, int64_t per_token,
                 int64_t dim) {
  const int64_t pairs = dim / 2;
  at::parallel_for(0, tokens, grain_of(2 * per_token * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cis + t * dim;  // (cos, sin) of each pair
      for (int64_t m = 0; m < per_token; ++m) {
        const T* xi = x + (t * per_token + m) * dim;
        T* o = out + (t * per_token + m) * dim;
        for (int64_t i = 0; i < pairs; ++i) {
          const float a = static_cast<float>(xi[2 * i]), b = static_cast<float>(xi[2 * i + 1]);
          o[2 * i] = static_cast<T>(a * c[2 * i] - b * c[2 * i + 1]);
          o[2 * i + 1] = static_cast<T>(a * c[2 * i + 1] + b * c[2 * i]);
        }
      }
    }
  });
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cis) {
  check_cpu(x, "rope's x");
  check_cpu(cis, "rope's cis");
  TORCH_CHECK(cis.scalar_type() == at::kComplexFloat && cis.dim() == 2 && x.dim() >= 2 &&
                  x.size(0) == cis.size(0) && x.size(-1) == 2 * cis.size(1),
              "rope: x [T, ..., d], cis [T, d/2] complex64");
  auto xc = x.contiguous(), c = at::view_as_real(cis.contiguous()).contiguous();
  auto out = at::empty_like(xc);
  const int64_t tokens = x.size(0), dim = x.size(-1);
  const int64_t per_token = tokens && dim ? xc.numel() / tokens / dim : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope", [&] {
    rope_kernel<scalar_t>(xc.data_ptr<scalar_t>(), c.data_ptr<float>(), out.data_ptr<scalar_t>(),
                          tokens, per_token, dim);
  });
  return out;
}

// ---- DeepSeek-V3's router: sigmoid scores, selection bias, group-limited top-k ----------------

std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& logits,
                                         const std::optional<at::Tensor>& bias, int64_t top_k,
                                         int64_t num_groups, int64_t groups_per_token,
                                         double scaling_factor, bool normalize) {
  check_cpu(logits, "route's logits");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "route: float32 logits [T, E]");
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  TORCH_CHECK(num_groups > 0 && experts % num_groups == 0 && groups_per_token >= 0 &&
                  groups_per_token <= num_groups && top_k >= 0 && top_k <= experts,
              "route: groups must divide the experts, top_k at most their number");
  auto l = logits.contiguous();
  at::Tensor b;
  if (bias.has_value()) {
    check_cpu(*bias, "route's bias");
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == experts, "route: bias [E]");
  }
  auto weights = at::empty({tokens, top_k}, l.options());
  auto indices = at::empty({tokens, top_k}, l.options().dtype(at::kLong));
  const float* lp = l.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* wp = weights.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  const int64_t per_group = experts / num_groups;
  const float neg = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, tokens, grain_of(16 * experts), [&](int64_t begin, int64_t end) {
    std::vector<float> score(experts), biased(experts), group_score(num_groups);
    std::vector<int64_t> order(std::max(experts, num_groups));
    // best first; ties: the lower index first
    auto best = [&](const std::vector<float>& v, int64_t n, int64_t k) {
      for (int64_t i = 0; i < n; ++i) order[i] = i;
      std::partial_sort(
          order.begin(), order.begin() + k, order.begin() + n,
          [&](int64_t x, int64_t y) { return v[x] > v[y] || (v[x] == v[y] && x < y); });
    };
    for (int64_t t = begin; t < end; ++t) {
      const float* row = lp + t * experts;
      for (int64_t e = 0; e < experts; ++e) score[e] = 1.f / (1.f + std::exp(-row[e]));
      for (int64_t e = 0; e < experts; ++e) biased[e] = bp ? score[e] + bp[e] : score[e];
      if (num_groups > 1) {
        for (int64_t g = 0; g < num_groups; ++g) {
          const float* v = biased.data() + g * per_group;
          float first = neg, second = neg;
          for (int64_t e = 0; e < per_group; ++e) {
            if (v[e] > first) {
              second = first;
              first = v[e];
            } else if (v[e] > second) {
              second = v[e];
            }
          }
          // with a bias, the sum of the group's two best; without, its best (DeepSeek-V2)
          group_score[g] = bp && per_group > 1 ? first + second : first;
        }
        best(group_score, num_groups, groups_per_token);
        std::vector<bool> kept(num_groups, false);
        for (int64_t i = 0; i < groups_per_token; ++i) kept[order[i]] = true;
        for (int64_t e = 0; e < experts; ++e)
          if (!kept[e / per_group]) biased[e] = neg;
      }
      best(biased, experts, top_k);
      float total = 0.f;
      for (int64_t i = 0; i < top_k; ++i) total += score[order[i]];
      for (int64_t i = 0; i < top_k; ++i) {
        const float w = normalize ? score[order[i]] / (total + 1e-20f) : score[order[i]];
        wp[t * top_k + i] = w * static_cast<float>(scaling_factor);
        ip[t * top_k + i] = order[i];
      }
    }
  });
  return {weights, indices};
}

}  // namespace

TORCH_LIBRARY(moeinfra, m) {
  m.def(
      "mla_decode(Tensor q_nope, Tensor q_pe, Tensor w_uk, Tensor w_uv_t, Tensor store, "
      "Tensor slots, Tensor lengths, float scale, ScalarType out_dtype) -> Tensor");
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale, bool bf16_pairs=True) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def(
      "expert_rows(Tensor rows, Tensor slots, Tensor w13, Tensor w2, float? limit, "
      "Tensor? combine=None) -> Tensor");
  m.def("rope(Tensor x, Tensor cis) -> Tensor");
  m.def(
      "route(Tensor logits, Tensor? bias, int top_k, int num_groups, int groups_per_token, "
      "float scaling_factor, bool normalize) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(moeinfra, CPU, m) {
  m.impl("mla_decode", &mla_decode);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("expert_rows", &expert_rows);
  m.impl("rope", &rope);
  m.impl("route", &route);
}
