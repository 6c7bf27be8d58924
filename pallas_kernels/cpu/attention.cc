// Decode attention (one query a row) over a float arena's pages as one XLA FFI call on a CPU:
// `pallas_kernels.blockwise.paged_attention_blockwise`'s rules for a float32 or bfloat16 arena
// read by queries of its own dtype, key by key, with no gather of the pages (its reference:
// that function and `paged_attention_reference`; tests/test_attention_native.py compares them on
// random arenas). Built with the other native calls by `pallas_kernels/cpu/_build.py`.
//
// Row b's lengths and num_tokens come from rows4[index] (i32[R, B, 4], a plan's rows: entries 2 and
// 3; index clipped into [0, R)), so a step's plan is read where it lies. Its query sits at position
// lengths[b] - num_tokens[b] (valid when num_tokens[b] > 0) and attends to the keys j < lengths[b],
// j <= its position, j > position - window (when windowed), whose page page_map[b, j / page_size]
// is mapped (>= 0; an id past the arena reads its last page, as the gather clips it). Per query
// head: s = (q . k) * sm_scale in float32 (checked
// finite, then soft-capped: cap * tanh(s / cap)); a key whose score or V row is not finite makes
// the head NaN; else softmax in float32, the weights rounded to the arena dtype for P @ V, the
// output acc / l rounded to it (0 where the head sees no key, or the query is not valid).
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "table.h"

namespace {

using namespace arena_native;

float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays a (quiet) NaN
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Element access for the two arena dtypes: float32 as is, bfloat16 widened exactly.
struct F32 {
  using T = float;
  static float load(T x) { return x; }
  static T store(float x) { return x; }
  static float round(float x) { return x; }
};
struct BF16 {
  using T = uint16_t;
  static float load(T x) { return bf16_to_f32(x); }
  static T store(float x) { return f32_to_bf16(x); }
  static float round(float x) { return bf16_to_f32(f32_to_bf16(x)); }
};

// Eight float32 lanes (GCC / Clang vector extensions: one AVX register where the build's
// `-march=native` has AVX, two SSE or NEON registers elsewhere).
typedef float v8 __attribute__((vector_size(32)));
v8 load8(const float* p) {
  v8 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

// a . b over n lanes: eight-lane partial sums, then the rest.
float dot(const float* a, const float* b, int64_t n) {
  v8 s8 = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) s8 += load8(a + i) * load8(b + i);
  float r = ((s8[0] + s8[4]) + (s8[1] + s8[5])) + ((s8[2] + s8[6]) + (s8[3] + s8[7]));
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

typedef int32_t vi8 __attribute__((vector_size(32)));

v8 select(vi8 mask, v8 a, v8 b) {  // a where mask, else b
  vi8 ai, bi;
  std::memcpy(&ai, &a, sizeof a);
  std::memcpy(&bi, &b, sizeof b);
  const vi8 r = (ai & mask) | (bi & ~mask);
  v8 out;
  std::memcpy(&out, &r, sizeof r);
  return out;
}

// exp of x <= 0, eight lanes (Cephes' expf: a degree-6 polynomial after range reduction, within
// 2 ulp of float32 exp; below -87.3 it gives exp(-87.3), ~1e-38, as good as 0 beside the max's 1).
v8 exp8(v8 x) {
  const v8 lo = x - x - 87.33654f;  // (x - x: the constant in every lane)
  x = select(x < lo, lo, x);
  v8 fx = x * 1.44269504088896341f + 0.5f;
  v8 t = __builtin_convertvector(__builtin_convertvector(fx, vi8), v8);  // truncated toward 0
  t = select(t > fx, t - 1.0f, t);                                         // floor
  x = x - t * 0.693359375f + t * 2.12194440e-4f;
  const v8 z = x * x;
  v8 y = ((((1.9875691500e-4f * x + 1.3981999507e-3f) * x + 8.3334519073e-3f) * x + 4.1665795894e-2f) * x +
          1.6666665459e-1f) * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  const vi8 e = (__builtin_convertvector(t, vi8) + 127) << 23;  // 2^t
  v8 scale;
  std::memcpy(&scale, &e, sizeof e);
  return y * scale;
}

// p[i] = exp(p[i] - m) over n lanes; returns their sum.
float exp_shifted(float* p, float m, int64_t n) {
  v8 sum8 = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8 e = exp8(load8(p + i) - m);
    std::memcpy(p + i, &e, sizeof e);
    sum8 += e;
  }
  float sum = ((sum8[0] + sum8[4]) + (sum8[1] + sum8[5])) + ((sum8[2] + sum8[6]) + (sum8[3] + sum8[7]));
  for (; i < n; ++i) {
    v8 x = {p[i] - m, 0, 0, 0, 0, 0, 0, 0};
    p[i] = exp8(x)[0];
    sum += p[i];
  }
  return sum;
}

// acc += p * x over n lanes.
void axpy(float* acc, float p, const float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8 y = load8(acc + i) + p * load8(x + i);
    std::memcpy(acc + i, &y, sizeof y);
  }
  for (; i < n; ++i) acc[i] += p * x[i];
}

// A K or V row as float32: the arena's own for float32, widened into `buf` for bfloat16.
template <typename E>
const float* as_f32(const typename E::T* row, float* buf, int64_t n) {
  if constexpr (std::is_same_v<typename E::T, float>) {
    return row;
  } else {
    for (int64_t d = 0; d < n; ++d) buf[d] = E::load(row[d]);
    return buf;
  }
}

template <typename E>
void Attend(const typename E::T* q, const typename E::T* k, const typename E::T* v, typename E::T* out,
            int64_t layer, const int32_t* page_map, const int32_t* rows4, int64_t window, bool windowed,
            float sm_scale, float soft_cap, int64_t B, int64_t Hq, int64_t D, int64_t Hkv, int64_t P, int64_t S,
            int64_t M) {
  const int64_t G = Hq / Hkv, max_keys = M * S;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> qf(G * D), row(D), scores, acc(G * D), m(G), l(G);
  std::vector<int64_t> keys;  // the row's attended keys' offsets into one head's layer of the arena
  std::vector<char> poisoned(G);
  for (int64_t b = 0; b < B; ++b) {
    // Row b's keys written and query tokens (rows4[b] = (_, _, lengths, num_tokens); num_tokens < 0:
    // the row reads nothing).
    const int64_t length = rows4[4 * b + 2], n = rows4[4 * b + 3], pos = length - n;
    // The attended keys [lo, hi), page by page: the mapped ones.
    int64_t hi = std::min({length, pos + 1, max_keys});
    int64_t lo = windowed ? std::max<int64_t>(0, pos - window + 1) : 0;
    keys.clear();
    if (n > 0)
      for (int64_t j = lo; j < hi; ++j) {
        const int32_t page = page_map[b * M + j / S];
        if (page >= 0) keys.push_back((std::min<int64_t>(page, P - 1) * S + j % S) * D);
      }
    const int64_t N = static_cast<int64_t>(keys.size());
    scores.resize(G * N);
    for (int64_t h = 0; h < Hkv; ++h) {
      typename E::T* o = out + (b * Hq + h * G) * D;
      if (N == 0) {  // no key (or no valid query): zeros
        for (int64_t i = 0; i < G * D; ++i) o[i] = E::store(0.0f);
        continue;
      }
      const int64_t head = (layer * Hkv + h) * P * S * D;  // [layer, h] of the arena [L, Hkv, P, S, D]
      for (int64_t i = 0; i < G * D; ++i) qf[i] = E::load(q[(b * Hq + h * G) * D + i]);
      for (int64_t g = 0; g < G; ++g) m[g] = -std::numeric_limits<float>::infinity(), l[g] = 0, poisoned[g] = 0;
      for (int64_t t = 0; t < N; ++t) {
        const float* kr = as_f32<E>(k + head + keys[t], row.data(), D);
        for (int64_t g = 0; g < G; ++g) {
          float s = dot(&qf[g * D], kr, D) * sm_scale;
          if (!std::isfinite(s)) {
            poisoned[g] = 1;
            continue;
          }
          if (soft_cap > 0) s = std::tanh(s / soft_cap) * soft_cap;
          scores[g * N + t] = s;
          m[g] = std::max(m[g], s);
        }
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t g = 0; g < G; ++g)  // the weights, in place of the scores
        if (!poisoned[g]) l[g] = exp_shifted(&scores[g * N], m[g], N);
      for (int64_t t = 0; t < N; ++t) {
        // A V row that is not finite leaves acc not finite (a weight >= 0 times inf or NaN), and
        // the head NaN below: no check of the row itself.
        const float* vr = as_f32<E>(v + head + keys[t], row.data(), D);
        for (int64_t g = 0; g < G; ++g)  // P @ V in the arena's dtype, accumulated in float32
          if (!poisoned[g]) axpy(&acc[g * D], E::round(scores[g * N + t]), vr, D);
      }
      for (int64_t g = 0; g < G; ++g) {
        bool bad = poisoned[g];
        for (int64_t d = 0; d < D && !bad; ++d) bad = !std::isfinite(acc[g * D + d]);  // an overflow: NaN as well
        for (int64_t d = 0; d < D; ++d) o[g * D + d] = E::store(bad ? nan : acc[g * D + d] / l[g]);
      }
    }
  }
}

ffi::Error AttendImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, I32 layer_buf, I32 page_map_buf,
                      I32 rows4_buf, I32 index_buf, I32 window_buf, ffi::Result<ffi::AnyBuffer> out, int64_t windowed,
                      float sm_scale, float soft_cap) {
  const auto qd = q.dimensions(), kd = k.dimensions(), md = page_map_buf.dimensions(), rd = rows4_buf.dimensions();
  bool same = kd.size() == v.dimensions().size();
  for (size_t i = 0; same && i < kd.size(); ++i) same = kd[i] == v.dimensions()[i];
  if (qd.size() != 3 || kd.size() != 5 || md.size() != 2 || rd.size() != 3 || !same ||
      q.element_type() != k.element_type() || v.element_type() != k.element_type() ||
      out->element_type() != q.element_type() || out->element_count() != q.element_count())
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "decode_attention: q [B, Hq, D], arenas [L, Hkv, P, S, D], rows4 [R, B, 4]");
  const int64_t B = qd[0], Hq = qd[1], D = qd[2], L = kd[0], Hkv = kd[1], P = kd[2], S = kd[3], M = md[1];
  if (kd[4] != D || Hkv <= 0 || Hq % Hkv != 0 || md[0] != B || L <= 0 || P <= 0 || S <= 0 || rd[0] <= 0 ||
      rd[1] != B || rd[2] != 4)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "decode_attention: the shapes do not fit");
  const int64_t layer = clip(layer_buf.typed_data()[0], 0, L - 1), window = window_buf.typed_data()[0];
  const int32_t* rows4 = rows4_buf.typed_data() + clip(index_buf.typed_data()[0], 0, rd[0] - 1) * B * 4;
  const int32_t* page_map = page_map_buf.typed_data();
  if (q.element_type() == ffi::DataType::F32) {
    Attend<F32>(static_cast<const float*>(q.untyped_data()), static_cast<const float*>(k.untyped_data()),
                static_cast<const float*>(v.untyped_data()), static_cast<float*>(out->untyped_data()), layer,
                page_map, rows4, window, windowed != 0, sm_scale, soft_cap, B, Hq, D, Hkv, P, S, M);
  } else if (q.element_type() == ffi::DataType::BF16) {
    using T = uint16_t;
    Attend<BF16>(reinterpret_cast<const T*>(q.untyped_data()), reinterpret_cast<const T*>(k.untyped_data()),
                 reinterpret_cast<const T*>(v.untyped_data()), reinterpret_cast<T*>(out->untyped_data()), layer,
                 page_map, rows4, window, windowed != 0, sm_scale, soft_cap, B, Hq, D, Hkv, P, S, M);
  } else {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "decode_attention: float32 or bfloat16 only");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ArenaDecodeAttention, AttendImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<I32>()
                                  .Arg<I32>()
                                  .Arg<I32>()
                                  .Arg<I32>()
                                  .Arg<I32>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("windowed")
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap"));
