// NVFP4 encode (round to nearest even) and decode on CPU: the hot loops of ds_nvfp4.quantize and dequantize,
// written as plain loops the compiler vectorises (Inductor's code for the same programs reaches ~25% of copy
// bandwidth on a 2-core AVX-512 CPU). They must give the same bytes as the eager kernels in
// ds_nvfp4/format/_kernels.py: encode does one float32 multiply per element (nothing to contract into an FMA) and the
// comparisons of e2m1.encode_rne, element 2i in the low nibble; decode multiplies the signed E2M1 value by the
// caller's float32 block factor and rounds to bfloat16 to nearest even.
// Every first call per argument signature is checked against the eager kernel (_compile.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <vector>
#include <atomic>
#include <limits>
#include <algorithm>
#include <type_traits>
#include <c10/util/Float8_e4m3fn.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define DS_NVFP4_AVX512 1
#endif

// E2M1 code of one float32 (already multiplied by its block's encode scale): round to nearest, ties to the
// even code, saturating at 6; NaN -> magnitude 0; sign = IEEE sign bit. Same comparisons as e2m1.encode_rne.
static inline uint8_t code_of(float y) {
  float a = std::fabs(y);
  uint32_t mag = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  uint32_t bits;
  std::memcpy(&bits, &y, 4);
  return static_cast<uint8_t>(mag | ((bits >> 31) << 3));
}

template <typename T> static inline float to_f32(T v);
template <> inline float to_f32<float>(float v) { return v; }
template <> inline float to_f32<uint16_t>(uint16_t v) {  // bfloat16 bits -> float32 (exact)
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

#ifdef DS_NVFP4_AVX512
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
// y = x * e, its sign bit and the magnitude index (the comparisons of code_of) of 16 lanes
template <typename T>
static inline __m512i e2m1_index_avx512(const T* x, float e, __m512i* sign_out) {
  const __m512 y = _mm512_mul_ps(load16(x), _mm512_set1_ps(e));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512 a = _mm512_castsi512_ps(_mm512_andnot_si512(sign, _mm512_castps_si512(y)));
  const __m512i one = _mm512_set1_epi32(1);
  __m512i idx = _mm512_setzero_si512();
  idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.25f), _CMP_GT_OQ), idx, one);
  idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.75f), _CMP_GE_OQ), idx, one);
  idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(a, _mm512_set1_ps(1.25f), _CMP_GT_OQ), idx, one);
  idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(a, _mm512_set1_ps(1.75f), _CMP_GE_OQ), idx, one);
  idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(a, _mm512_set1_ps(2.5f), _CMP_GT_OQ), idx, one);
  idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(a, _mm512_set1_ps(3.5f), _CMP_GE_OQ), idx, one);
  idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(a, _mm512_set1_ps(5.0f), _CMP_GT_OQ), idx, one);
  *sign_out = sign;
  return idx;
}
// the 16 codes (index | sign at bit 3) packed two per byte: a 64-bit lane holds codes 2j (low) and 2j+1 (high)
static inline void store_codes_avx512(__m512i idx, __m512i sign, uint8_t* codes) {
  __m512i c = _mm512_or_si512(idx, _mm512_srli_epi32(sign, 28));
  c = _mm512_or_si512(c, _mm512_srli_epi64(c, 28));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(codes), _mm512_cvtepi64_epi8(c));
}
// One 16-element block of encode_sr_rows with AVX-512: the same float32 steps per lane (|y| / step + u floored,
// times step, capped at 6), the code read off by the comparisons of code_of, packed two per byte.
template <typename T>
static inline void encode_sr_block_avx512(const T* x, float e, const uint8_t* rnd, uint8_t* out) {
  const __m512 y = _mm512_mul_ps(load16(x), _mm512_set1_ps(e));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512 a = _mm512_castsi512_ps(_mm512_andnot_si512(sign, _mm512_castps_si512(y)));
  const __mmask16 lt2 = _mm512_cmp_ps_mask(a, _mm512_set1_ps(2.0f), _CMP_LT_OQ);
  const __mmask16 lt4 = _mm512_cmp_ps_mask(a, _mm512_set1_ps(4.0f), _CMP_LT_OQ);
  const __m512 st = _mm512_mask_mov_ps(_mm512_mask_mov_ps(_mm512_set1_ps(2.0f), lt4, _mm512_set1_ps(1.0f)), lt2,
                                       _mm512_set1_ps(0.5f));
  const __m512 inv = _mm512_mask_mov_ps(_mm512_mask_mov_ps(_mm512_set1_ps(0.5f), lt4, _mm512_set1_ps(1.0f)), lt2,
                                        _mm512_set1_ps(2.0f));
  const __m512 u = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rnd)))),
      _mm512_set1_ps(1.0f / 256.0f));
  const __m512 t = _mm512_mul_ps(
      _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(a, inv), u), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC), st);
  const __m512 q = _mm512_min_ps(_mm512_set1_ps(6.0f), t);  // NaN stays NaN and compares false: magnitude 0
  const __m512i one = _mm512_set1_epi32(1);
  __m512i idx = _mm512_setzero_si512();
  idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(q, _mm512_set1_ps(0.25f), _CMP_GT_OQ), idx, one);
  idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(q, _mm512_set1_ps(0.75f), _CMP_GE_OQ), idx, one);
  idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(q, _mm512_set1_ps(1.25f), _CMP_GT_OQ), idx, one);
  idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(q, _mm512_set1_ps(1.75f), _CMP_GE_OQ), idx, one);
  idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(q, _mm512_set1_ps(2.5f), _CMP_GT_OQ), idx, one);
  idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(q, _mm512_set1_ps(3.5f), _CMP_GE_OQ), idx, one);
  idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(q, _mm512_set1_ps(5.0f), _CMP_GT_OQ), idx, one);
  store_codes_avx512(idx, sign, out);
}
#endif

template <typename T>
static void encode_rows(const T* __restrict x, const float* __restrict enc, uint8_t* __restrict out, int64_t m, int64_t k, int64_t row_div) {
  const int64_t nb = k / 16;
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * k;
      const float* er = enc + (r / row_div) * nb;
      uint8_t* orow = out + r * (k / 2);
      for (int64_t b = 0; b < nb; ++b) {
        const float e = er[b];
#ifdef DS_NVFP4_AVX512
        __m512i sign;
        const __m512i idx = e2m1_index_avx512(xr + b * 16, e, &sign);
        store_codes_avx512(idx, sign, orow + b * 8);
        continue;
#endif
        float y[16];
        for (int j = 0; j < 16; ++j) y[j] = to_f32(xr[b * 16 + j]) * e;
        uint8_t c[16];
        for (int j = 0; j < 16; ++j) c[j] = code_of(y[j]);
        for (int j = 0; j < 8; ++j) orow[b * 8 + j] = static_cast<uint8_t>(c[2 * j] | (c[2 * j + 1] << 4));
      }
    }
  });
}

torch::Tensor encode_nearest(torch::Tensor x, torch::Tensor enc, int64_t row_div) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 16 == 0, "x: contiguous [M, K], K % 16 == 0");
  TORCH_CHECK(enc.scalar_type() == torch::kFloat32 && enc.is_contiguous(), "enc: contiguous float32");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(enc.numel() == ((m + row_div - 1) / row_div) * (k / 16), "enc: one scale per block");
  auto out = torch::empty({m, k / 2}, x.options().dtype(torch::kUInt8));
  if (x.scalar_type() == torch::kFloat32) {
    encode_rows<float>(x.data_ptr<float>(), enc.data_ptr<float>(), out.data_ptr<uint8_t>(), m, k, row_div);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "x: float32 or bfloat16");
    encode_rows<uint16_t>(reinterpret_cast<const uint16_t*>(x.data_ptr()), enc.data_ptr<float>(),
                          out.data_ptr<uint8_t>(), m, k, row_div);
  }
  return out;
}

// Stochastic rounding onto the E2M1 grid (the twin of e2m1.encode_stochastic after _kernels._scaled): y = x * enc_b,
// step = 0.5 below 2, 1 below 4, else 2; q = min(floor(|y| / step + u) * step, 6) with u = random_byte / 256; the
// code of q (exactly on the grid) with the IEEE sign of y. NaN stays NaN through min (as torch.clamp) -> code 0.
template <typename T>
static void encode_sr_rows(const T* x, const float* enc, const uint8_t* rnd, uint8_t* out, int64_t m, int64_t k,
                           int64_t row_div) {
  const int64_t nb = k / 16;
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * k;
      const uint8_t* ur = rnd + r * k;
      const float* er = enc + (r / row_div) * nb;
      uint8_t* orow = out + r * (k / 2);
      for (int64_t b = 0; b < nb; ++b) {
        const float e = er[b];
#ifdef DS_NVFP4_AVX512
        encode_sr_block_avx512(xr + b * 16, e, ur + b * 16, orow + b * 8);
        continue;
#endif
        uint8_t c[16];
        for (int j = 0; j < 16; ++j) {
          const float y = to_f32(xr[b * 16 + j]) * e;
          const float a = std::fabs(y);
          const float st = a < 2.0f ? 0.5f : (a < 4.0f ? 1.0f : 2.0f);
          const float inv = a < 2.0f ? 2.0f : (a < 4.0f ? 1.0f : 0.5f);  // a * inv == a / st exactly (2^n)
          const float u = static_cast<float>(ur[b * 16 + j]) * (1.0f / 256.0f);
          const float t = std::floor(a * inv + u) * st;
          const float q = t > 6.0f ? 6.0f : t;  // NaN stays NaN (as torch.clamp) and gets magnitude code 0
          uint32_t bits;
          std::memcpy(&bits, &y, 4);
          const uint32_t mag = (q > 0.25f) + (q >= 0.75f) + (q > 1.25f) + (q >= 1.75f) + (q > 2.5f) + (q >= 3.5f) +
                               (q > 5.0f);
          c[j] = static_cast<uint8_t>((a != a ? 0u : mag) | ((bits >> 31) << 3));
        }
        for (int j = 0; j < 8; ++j) orow[b * 8 + j] = static_cast<uint8_t>(c[2 * j] | (c[2 * j + 1] << 4));
      }
    }
  });
}

torch::Tensor encode_stochastic(torch::Tensor x, torch::Tensor enc, int64_t row_div, torch::Tensor rnd) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 16 == 0, "x: contiguous [M, K], K % 16 == 0");
  TORCH_CHECK(enc.scalar_type() == torch::kFloat32 && enc.is_contiguous(), "enc: contiguous float32");
  TORCH_CHECK(rnd.scalar_type() == torch::kUInt8 && rnd.is_contiguous() && rnd.numel() == x.numel(), "rnd: uint8 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(enc.numel() == ((m + row_div - 1) / row_div) * (k / 16), "enc: one scale per block");
  auto out = torch::empty({m, k / 2}, x.options().dtype(torch::kUInt8));
  if (x.scalar_type() == torch::kFloat32) {
    encode_sr_rows<float>(x.data_ptr<float>(), enc.data_ptr<float>(), rnd.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), m, k, row_div);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "x: float32 or bfloat16");
    encode_sr_rows<uint16_t>(reinterpret_cast<const uint16_t*>(x.data_ptr()), enc.data_ptr<float>(),
                             rnd.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), m, k, row_div);
  }
  return out;
}

// float32 -> bfloat16 bits, round to nearest even, as c10::BFloat16's constructor does (NaN -> 0x7FC0).
static inline uint16_t to_bf16_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t r = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  return f != f ? static_cast<uint16_t>(0x7FC0) : r;  // a select, not a branch: the loops vectorise
}

// E2M1 values of the 16 codes with the sign applied as the eager kernel does (magnitude * -1 for codes 8..15, so
// code 8 is -0.0).
static const float kE2M1Signed[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

#ifdef DS_NVFP4_AVX512
// float32 -> bfloat16 bits of 16 lanes, round to nearest even, NaN -> 0x7FC0 (to_bf16_bits, vectorised)
static inline __m256i bf16_rne16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
// One 16-element block of decode_rows: the 16 signed E2M1 values times the block's factor (one float32 multiply
// each, as the table of the scalar loop), picked per code by a lane permute.
static inline void decode_block_avx512(const uint8_t* data, float f, uint16_t* out) {
  const __m512 table = _mm512_mul_ps(_mm512_loadu_ps(kE2M1Signed), _mm512_set1_ps(f));
  const __m512i bytes = _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(data)));
  const __m512i idx = _mm512_or_si512(_mm512_and_si512(bytes, _mm512_set1_epi64(0x0F)),
                                      _mm512_slli_epi64(_mm512_srli_epi64(bytes, 4), 32));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bf16_rne16(_mm512_permutexvar_ps(idx, table)));
}
static inline void decode_block_avx512(const uint8_t* data, float f, float* out) {
  const __m512 table = _mm512_mul_ps(_mm512_loadu_ps(kE2M1Signed), _mm512_set1_ps(f));
  const __m512i bytes = _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(data)));
  const __m512i idx = _mm512_or_si512(_mm512_and_si512(bytes, _mm512_set1_epi64(0x0F)),
                                      _mm512_slli_epi64(_mm512_srli_epi64(bytes, 4), 32));
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(idx, table));
}
#endif

// Dequantize packed codes [M, K/2] with per-block factors [ceil(M/row_div), K/16] (scale * amax / 2688, computed
// by the caller exactly as the eager kernel does): out = cast(e2m1(code) * factor). A block has 16 elements but
// only 16 possible codes, so the 16 products (and their casts) are computed once per block and looked up.
template <typename Out, typename Cast>
static void decode_rows(const uint8_t* data, const float* factor, Out* out, int64_t m, int64_t k, int64_t row_div,
                        Cast cast) {
  const int64_t nb = k / 16;
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    Out table[16];
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* dr = data + r * (k / 2);
      const float* fr = factor + (r / row_div) * nb;
      Out* orow = out + r * k;
      for (int64_t b = 0; b < nb; ++b) {
        const float f = fr[b];
#ifdef DS_NVFP4_AVX512
        if constexpr (std::is_same_v<Out, uint16_t> || std::is_same_v<Out, float>) {
          decode_block_avx512(dr + b * 8, f, orow + b * 16);
          continue;
        }
#endif
        for (int c = 0; c < 16; ++c) table[c] = cast(kE2M1Signed[c] * f);
        for (int j = 0; j < 8; ++j) {
          const uint8_t byte = dr[b * 8 + j];
          orow[b * 16 + 2 * j] = table[byte & 0x0F];
          orow[b * 16 + 2 * j + 1] = table[byte >> 4];
        }
      }
    }
  });
}

torch::Tensor decode(torch::Tensor data, torch::Tensor factor, int64_t row_div, bool bf16) {
  TORCH_CHECK(data.dim() == 2 && data.is_contiguous() && data.scalar_type() == torch::kUInt8, "data: uint8 [M, K/2]");
  TORCH_CHECK(factor.scalar_type() == torch::kFloat32 && factor.is_contiguous(), "factor: contiguous float32");
  const int64_t m = data.size(0), k = data.size(1) * 2;
  TORCH_CHECK(k % 16 == 0 && factor.numel() == ((m + row_div - 1) / row_div) * (k / 16), "factor: one per block");
  auto out = torch::empty({m, k}, data.options().dtype(bf16 ? torch::kBFloat16 : torch::kFloat32));
  if (bf16) {
    decode_rows<uint16_t>(data.data_ptr<uint8_t>(), factor.data_ptr<float>(),
                          reinterpret_cast<uint16_t*>(out.data_ptr()), m, k, row_div, to_bf16_bits);
  } else {
    decode_rows<float>(data.data_ptr<uint8_t>(), factor.data_ptr<float>(), out.data_ptr<float>(), m, k, row_div,
                       [](float v) { return v; });
  }
  return out;
}

#ifdef DS_NVFP4_AVX512
// One 16-element block of encode_values_rows with AVX-512: the same float32 operations per lane (one multiply by
// enc, the seven comparisons of code_of, the grid value by a lane permute instead of selects, times s), the values
// stored exactly (truncated to bfloat16, or as float32) and the codes packed two per byte.
static inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline void store16(uint16_t* p, __m512 v) {  // exact values: truncation is the rounding
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}
template <typename T, typename Out>
static inline void encode_block_avx512(const T* x, float e, float s, Out* vals, uint8_t* codes) {
  __m512i sign;
  const __m512i idx = e2m1_index_avx512(x, e, &sign);
  const __m512 grid = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, 0.0f, 0.5f, 1.0f, 1.5f, 2.0f,
                                     3.0f, 4.0f, 6.0f);
  const __m512 mag = _mm512_permutexvar_ps(idx, grid);
  const __m512 val = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), sign)),
                                   _mm512_set1_ps(s));
  store16(vals, val);
  if (codes != nullptr) store_codes_avx512(idx, sign, codes);
}
#endif

// Quantize and produce the GEMM operand in one pass: for each element, code = e2m1(x * enc_b) (round to nearest
// even, as encode_rows) and value = e2m1_value(code) * s_b (exact: at most 6 significant bits), written as float32
// or bfloat16 (exact either way). Optionally also the packed codes (the storage a backward or a checkpoint needs).
// scale holds the float32 block scales s_b (E4M3 values) in the layout of enc.
template <typename T, typename Out, typename Cast>
static void encode_values_rows(const T* __restrict x, const float* __restrict enc, const float* __restrict scale,
                               Out* __restrict vals, uint8_t* __restrict codes, int64_t m,
                               int64_t k, int64_t row_div, Cast cast) {
  const int64_t nb = k / 16;
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * k;
      const float* er = enc + (r / row_div) * nb;
      const float* sr = scale + (r / row_div) * nb;
      Out* vrow = vals + r * k;
      for (int64_t b = 0; b < nb; ++b) {
        const float e = er[b];
        const float s = sr[b];
#ifdef DS_NVFP4_AVX512
        if constexpr (std::is_same_v<Out, uint16_t> || std::is_same_v<Out, float>) {
          encode_block_avx512(xr + b * 16, e, s, vrow + b * 16, codes ? codes + r * (k / 2) + b * 8 : nullptr);
          continue;
        }
#endif
        uint32_t idx[16], sign[16];
        float val[16];
        // one chain of comparisons (those of code_of) gives both the code and the grid value: steps of 0.5 up to 2,
        // of 1 up to 4, then 6 (selects, no table gather, so it vectorises); the sign is the IEEE sign of y (code 8
        // -> -0.0). value = mag * s has at most 6 significant bits, so its cast is exact (cast_exact).
        for (int j = 0; j < 16; ++j) {
          const float y = to_f32(xr[b * 16 + j]) * e;
          const float a = std::fabs(y);
          const uint32_t i = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                             (a > 5.0f);
          const float mag = i <= 4u ? 0.5f * static_cast<float>(i) : (i == 7u ? 6.0f : static_cast<float>(i) - 2.0f);
          uint32_t bits;
          std::memcpy(&bits, &y, 4);
          idx[j] = i;
          sign[j] = bits >> 31;
          val[j] = std::copysign(mag, y) * s;
        }
        for (int j = 0; j < 16; ++j) vrow[b * 16 + j] = cast(val[j]);
        if (codes != nullptr) {
          uint8_t* crow = codes + r * (k / 2);
          for (int j = 0; j < 8; ++j)
            crow[b * 8 + j] = static_cast<uint8_t>((idx[2 * j] | (sign[2 * j] << 3)) |
                                                   ((idx[2 * j + 1] | (sign[2 * j + 1] << 3)) << 4));
        }
      }
    }
  });
}

std::vector<torch::Tensor> encode_values(torch::Tensor x, torch::Tensor enc, torch::Tensor scale, int64_t row_div,
                                         bool bf16, bool want_codes) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 16 == 0, "x: contiguous [M, K], K % 16 == 0");
  TORCH_CHECK(enc.scalar_type() == torch::kFloat32 && enc.is_contiguous(), "enc: contiguous float32");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.numel() == enc.numel(),
              "scale: contiguous float32, enc's layout");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(enc.numel() == ((m + row_div - 1) / row_div) * (k / 16), "enc: one scale per block");
  auto vals = torch::empty({m, k}, x.options().dtype(bf16 ? torch::kBFloat16 : torch::kFloat32));
  torch::Tensor codes = want_codes ? torch::empty({m, k / 2}, x.options().dtype(torch::kUInt8)) : torch::Tensor();
  uint8_t* cp = want_codes ? codes.data_ptr<uint8_t>() : nullptr;
  const float* e = enc.data_ptr<float>();
  const float* s = scale.data_ptr<float>();
  // the values are exact in bfloat16 (<= 6 significant bits): truncation is the rounding, and keeps NaN a NaN
  auto to_bf16 = [](float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    return static_cast<uint16_t>(bits >> 16);
  };
  auto same = [](float v) { return v; };
  if (x.scalar_type() == torch::kFloat32) {
    const float* xp = x.data_ptr<float>();
    if (bf16) encode_values_rows<float>(xp, e, s, reinterpret_cast<uint16_t*>(vals.data_ptr()), cp, m, k, row_div, to_bf16);
    else encode_values_rows<float>(xp, e, s, vals.data_ptr<float>(), cp, m, k, row_div, same);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "x: float32 or bfloat16");
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    if (bf16) encode_values_rows<uint16_t>(xp, e, s, reinterpret_cast<uint16_t*>(vals.data_ptr()), cp, m, k, row_div, to_bf16);
    else encode_values_rows<uint16_t>(xp, e, s, vals.data_ptr<float>(), cp, m, k, row_div, same);
  }
  if (want_codes) return {vals, codes};
  return {vals};
}

// The whole quantize -> operand step in C++ (the twin of quantize_values' eager composition block_amax -> scales ->
// encode_values): block amaxes (NaN propagates), the per-tensor amax (given or their max), the float32 scale
// arithmetic of _kernels.scales in the same order (E4M3 rounding by c10's converter, as Tensor.to does), then the
// codes and values. One call instead of three: the per-call overhead of the compiled kernels dominated small layers.
static inline float nan_max(float m, float a) { return (a > m || std::isnan(a)) ? a : m; }

template <typename T>
static void block_amax_rows(const T* __restrict x, float* __restrict bamax, int64_t m, int64_t k, int64_t row_div) {
  const int64_t nb = k / 16;
  const int64_t groups = (m + row_div - 1) / row_div;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      float* out = bamax + g * nb;
      for (int64_t b = 0; b < nb; ++b) out[b] = 0.0f;
      for (int64_t r = g * row_div; r < std::min(m, (g + 1) * row_div); ++r) {
        const T* xr = x + r * k;
        for (int64_t b = 0; b < nb; ++b) {
#ifdef DS_NVFP4_AVX512
          {  // |x| max over 16 lanes; a NaN anywhere makes the block NaN (as the eager kernel's amax does)
            const __m512 v = _mm512_abs_ps(load16(xr + b * 16));
            const bool nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
            out[b] = nan ? std::numeric_limits<float>::quiet_NaN() : nan_max(out[b], _mm512_reduce_max_ps(v));
            continue;
          }
#endif
          // max over the block without a loop-carried NaN test (so it vectorises); NaN re-applied after
          float v[16];
          bool has_nan = false;
          for (int j = 0; j < 16; ++j) {
            v[j] = std::fabs(to_f32(xr[b * 16 + j]));
            has_nan |= v[j] != v[j];
          }
          for (int w = 8; w > 0; w /= 2)
            for (int j = 0; j < w; ++j) v[j] = v[j + w] > v[j] ? v[j + w] : v[j];
          out[b] = has_nan ? std::numeric_limits<float>::quiet_NaN() : nan_max(out[b], v[0]);
        }
      }
    }
  });
}

// float32 t in [0, 448] (or NaN) -> E4M3 bits and value, round to nearest even, subnormals included: the same result
// as c10's converter (used by Tensor.to(float8_e4m3fn)) on this range, without its per-call cost.
static inline void e4m3_of_nonnegative(float t, uint8_t* code, float* value) {
  if (t != t) {
    *code = 0x7F;
    *value = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  if (t < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9 (t * 512 is exact)
    const float q = std::nearbyint(t * 512.0f);  // default rounding mode: nearest even
    *code = static_cast<uint8_t>(q);
    *value = q * (1.0f / 512.0f);
    return;
  }
  uint32_t bits;
  std::memcpy(&bits, &t, 4);
  const uint32_t r = (bits + 0x7FFFFu + ((bits >> 20) & 1u)) & ~0xFFFFFu;  // keep 3 mantissa bits, RNE
  std::memcpy(value, &r, 4);
  *code = static_cast<uint8_t>((r >> 20) - (120u << 3));  // exponent bias 127 -> 7
}

// The block scales of n blocks with one per-tensor scale: s_b = e4m3(min(bamax * s_enc6, 448)) (code and value) and
// enc_b = min(1 / (s_b * s_dec), FLT_MAX), exactly the scalar steps (e4m3_of_nonnegative), 16 blocks at a time with
// AVX-512: the normal range by the same integer rounding of the bits, the subnormal range by a round-to-nearest-even
// of t * 512, NaN to code 0x7F.
static void scale_blocks(const float* ba, int64_t n, float s_enc6, float s_dec, uint8_t* sb, float* sf, float* ef) {
  const float flt_max = std::numeric_limits<float>::max();
  int64_t i = 0;
#ifdef DS_NVFP4_AVX512
  const __m512 cap = _mm512_set1_ps(448.0f), fmax = _mm512_set1_ps(flt_max), one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    const __m512 t = _mm512_min_ps(cap, _mm512_mul_ps(_mm512_loadu_ps(ba + i), _mm512_set1_ps(s_enc6)));
    const __m512i bits = _mm512_castps_si512(t);
    const __m512i r = _mm512_and_si512(
        _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFFF)),
                         _mm512_and_si512(_mm512_srli_epi32(bits, 20), _mm512_set1_epi32(1))),
        _mm512_set1_epi32(static_cast<int>(~0xFFFFFu)));
    __m512 value = _mm512_castsi512_ps(r);
    __m512i code = _mm512_sub_epi32(_mm512_srli_epi32(r, 20), _mm512_set1_epi32(120 << 3));
    const __mmask16 sub = _mm512_cmp_ps_mask(t, _mm512_set1_ps(0.015625f), _CMP_LT_OQ);
    const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(512.0f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    value = _mm512_mask_mov_ps(value, sub, _mm512_mul_ps(q, _mm512_set1_ps(1.0f / 512.0f)));
    code = _mm512_mask_mov_epi32(code, sub, _mm512_cvttps_epi32(q));
    const __mmask16 nan = _mm512_cmp_ps_mask(t, t, _CMP_UNORD_Q);
    value = _mm512_mask_mov_ps(value, nan, t);
    code = _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(0x7F));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(sb + i), _mm512_cvtepi32_epi8(code));
    _mm512_storeu_ps(sf + i, value);
    _mm512_storeu_ps(ef + i, _mm512_min_ps(fmax, _mm512_div_ps(one, _mm512_mul_ps(value, _mm512_set1_ps(s_dec)))));
  }
#endif
  for (; i < n; ++i) {
    float t = ba[i] * s_enc6;
    if (t > 448.0f) t = 448.0f;
    uint8_t qb;
    float qf;
    e4m3_of_nonnegative(t, &qb, &qf);
    sb[i] = qb;
    sf[i] = qf;
    float e = 1.0f / (qf * s_dec);
    if (e > flt_max) e = flt_max;
    ef[i] = e;
  }
}

// The block scales of x with its per-tensor amax (given or the max of the block amaxes), the twin of the eager
// composition _kernels.scales(_kernels.block_amax(x)): returns {scale e4m3 [groups, nb], its float32 values, enc_b
// float32 [groups, nb], the float32 0-dim amax used (NaN when the input or the given amax is not finite)}.
static std::vector<torch::Tensor> block_scales_all(const torch::Tensor& x, const c10::optional<torch::Tensor>& amax,
                                                   int64_t row_div) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 16 == 0, "x: contiguous [M, K], K % 16 == 0");
  const int64_t m = x.size(0), k = x.size(1), nb = k / 16;
  const int64_t groups = (m + row_div - 1) / row_div;
  auto f32 = x.options().dtype(torch::kFloat32);
  auto bamax = torch::empty({groups, nb}, f32);
  float* ba = bamax.data_ptr<float>();
  if (x.scalar_type() == torch::kFloat32) {
    block_amax_rows<float>(x.data_ptr<float>(), ba, m, k, row_div);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "x: float32 or bfloat16");
    block_amax_rows<uint16_t>(reinterpret_cast<const uint16_t*>(x.data_ptr()), ba, m, k, row_div);
  }
  const int64_t n_blocks = groups * nb;
  float local = 0.0f;
  for (int64_t i = 0; i < n_blocks; ++i) local = nan_max(local, ba[i]);
  if (n_blocks == 0) local = -std::numeric_limits<float>::infinity();
  float used = local;
  if (amax.has_value()) {
    TORCH_CHECK(amax->numel() == 1 && amax->scalar_type() == torch::kFloat32, "amax: one float32");
    used = amax->contiguous().data_ptr<float>()[0];
  }
  if (!(std::isfinite(local) && std::isfinite(used))) used = std::numeric_limits<float>::quiet_NaN();
  const float flt_max = std::numeric_limits<float>::max();
  float s_enc = 2688.0f / used;
  if (used == 0.0f || s_enc == 0.0f) s_enc = 1.0f;
  if (s_enc > flt_max) s_enc = flt_max;
  const float s_dec = 1.0f / s_enc;
  const float s_enc6 = s_enc * (1.0f / 6.0f);
  auto scale = torch::empty({groups, nb}, x.options().dtype(at::kFloat8_e4m3fn));
  auto scale_f = torch::empty({groups, nb}, f32);
  auto enc = torch::empty({groups, nb}, f32);
  scale_blocks(ba, n_blocks, s_enc6, s_dec, reinterpret_cast<uint8_t*>(scale.data_ptr()), scale_f.data_ptr<float>(),
               enc.data_ptr<float>());
  return {scale, scale_f, enc, torch::full({}, used, f32)};
}

// {amax used, scale e4m3, enc_b}: what _kernels.block_scales returns (the storage quantize's first step), without
// the torch.compile of the eager composition in every process (seconds of start-up per process).
std::vector<torch::Tensor> block_scales(torch::Tensor x, c10::optional<torch::Tensor> amax, int64_t row_div) {
  auto s = block_scales_all(x, amax, row_div);
  return {s[3], s[0], s[2]};
}

std::vector<torch::Tensor> quantize_operand(torch::Tensor x, c10::optional<torch::Tensor> amax, int64_t row_div,
                                            bool bf16, bool want_codes) {
  auto s = block_scales_all(x, amax, row_div);
  auto out = encode_values(x, s[2], s[1], row_div, bf16, want_codes);
  if (want_codes) return {out[0], out[1], s[0], s[3]};
  return {out[0], torch::empty({0}, x.options().dtype(torch::kUInt8)), s[0], s[3]};
}

// quantize_operand for groups of rows, each group with its own per-tensor amax (MoE: each expert's tokens, or each
// expert's weight stacked to [E*N, K]); row_group names the group of each block row (of each row for 1x16, of each
// 16-row tile for 16x16). The same float32 steps per group as quantize_operand (format/grouped.py is the eager
// definition): a group's local amax is the NaN-propagating max of its block amaxes (0 without rows), the given
// amax replaces it, a non-finite one poisons the group.
std::vector<torch::Tensor> quantize_operand_grouped(torch::Tensor x, torch::Tensor row_group, int64_t groups,
                                                    c10::optional<torch::Tensor> amax, int64_t row_div, bool bf16,
                                                    bool want_codes) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 16 == 0, "x: contiguous [M, K], K % 16 == 0");
  const int64_t m = x.size(0), k = x.size(1), nb = k / 16;
  const int64_t rows = (m + row_div - 1) / row_div;
  TORCH_CHECK(row_group.scalar_type() == torch::kInt64 && row_group.numel() == rows, "row_group: int64, per block row");
  auto rg_t = row_group.contiguous();
  const int64_t* rg = rg_t.data_ptr<int64_t>();
  auto f32 = x.options().dtype(torch::kFloat32);
  auto bamax = torch::empty({rows, nb}, f32);
  float* ba = bamax.data_ptr<float>();
  if (x.scalar_type() == torch::kFloat32) {
    block_amax_rows<float>(x.data_ptr<float>(), ba, m, k, row_div);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "x: float32 or bfloat16");
    block_amax_rows<uint16_t>(reinterpret_cast<const uint16_t*>(x.data_ptr()), ba, m, k, row_div);
  }
  std::vector<float> local(groups, 0.0f);
  std::vector<char> seen(groups, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t g = rg[r];
    TORCH_CHECK(g >= 0 && g < groups, "row_group: out of range");
    float v = seen[g] ? local[g] : -std::numeric_limits<float>::infinity();
    for (int64_t b = 0; b < nb; ++b) v = nan_max(v, ba[r * nb + b]);
    local[g] = v;
    seen[g] = 1;
  }
  const float* given = nullptr;
  torch::Tensor amax_c;
  if (amax.has_value()) {
    amax_c = amax->to(torch::kFloat32).contiguous();
    TORCH_CHECK(amax_c.numel() == groups, "amax: one float32 per group");
    given = amax_c.data_ptr<float>();
  }
  const float flt_max = std::numeric_limits<float>::max();
  auto used_t = torch::empty({groups}, f32);
  float* used = used_t.data_ptr<float>();
  std::vector<float> s_enc6(groups), s_dec(groups);
  for (int64_t g = 0; g < groups; ++g) {
    const float lg = seen[g] ? local[g] : 0.0f;
    float u = given ? given[g] : lg;
    if (!(std::isfinite(lg) && std::isfinite(u))) u = std::numeric_limits<float>::quiet_NaN();
    used[g] = u;
    float se = 2688.0f / u;
    if (u == 0.0f || se == 0.0f) se = 1.0f;
    if (se > flt_max) se = flt_max;
    s_dec[g] = 1.0f / se;
    s_enc6[g] = se * (1.0f / 6.0f);
  }
  auto scale = torch::empty({rows, nb}, x.options().dtype(at::kFloat8_e4m3fn));
  auto scale_f = torch::empty({rows, nb}, f32);
  auto enc = torch::empty({rows, nb}, f32);
  uint8_t* sb = reinterpret_cast<uint8_t*>(scale.data_ptr());
  float* sf = scale_f.data_ptr<float>();
  float* ef = enc.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t g = rg[r];
    scale_blocks(ba + r * nb, nb, s_enc6[g], s_dec[g], sb + r * nb, sf + r * nb, ef + r * nb);
  }
  auto out = encode_values(x, enc, scale_f, row_div, bf16, want_codes);
  if (want_codes) return {out[0], out[1], scale, used_t};
  return {out[0], torch::empty({0}, x.options().dtype(torch::kUInt8)), scale, used_t};
}

static inline float widen(uint16_t v) { return to_f32(v); }
static inline float widen(float v) { return v; }
static inline void store(uint16_t* o, float y, unsigned* bad) {
  const uint16_t h = to_bf16_bits(y);
  *o = h;
  *bad |= (h & 0x7F80u) == 0x7F80u;
}
static inline void store(float* o, float y, unsigned* bad) {
  *o = y;
  uint32_t bits;
  std::memcpy(&bits, &y, 4);
  *bad |= (bits & 0x7F800000u) == 0x7F800000u;
}

// One row of the epilogue; restrict-qualified and without a loop-carried branch, so it vectorises.
template <typename In, typename Out>
static unsigned epilogue_row(const In* __restrict acc, Out* __restrict out, const float* __restrict bias, float a,
                             int64_t n) {
  unsigned bad = 0;
  if (bias != nullptr) {
    for (int64_t c = 0; c < n; ++c) store(out + c, widen(acc[c]) * a + bias[c], &bad);
  } else {
    for (int64_t c = 0; c < n; ++c) store(out + c, widen(acc[c]) * a, &bad);
  }
  return bad;
}

// The GEMM epilogue of the emulation: out = cast(float(acc) * alpha [+ float(bias)]) in that order (no FMA: the
// extension is built with -ffp-contract=off), and whether any output is NaN/Inf (the layer's non-finite flag).
// alpha: float32 0-dim (one GEMM), or [M], one per row (a grouped GEMM: each row's group's alpha).
std::vector<torch::Tensor> epilogue(torch::Tensor acc, torch::Tensor alpha, c10::optional<torch::Tensor> bias,
                                    bool bf16_out) {
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous(), "acc: contiguous [M, N]");
  TORCH_CHECK(acc.scalar_type() == torch::kBFloat16 || acc.scalar_type() == torch::kFloat32, "acc: bf16 or f32");
  TORCH_CHECK(alpha.scalar_type() == torch::kFloat32, "alpha: float32");
  const int64_t m = acc.size(0), n = acc.size(1);
  const bool per_row = alpha.dim() == 1;
  TORCH_CHECK(alpha.dim() == 0 || (per_row && alpha.numel() == m), "alpha: 0-dim or [M]");
  const torch::Tensor alpha_c = alpha.contiguous();
  const float* alpha_p = alpha_c.data_ptr<float>();
  torch::Tensor bias_f;
  const float* bp = nullptr;
  if (bias.has_value()) {
    bias_f = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(bias_f.numel() == n, "bias: [N]");
    bp = bias_f.data_ptr<float>();
  }
  auto out = torch::empty({m, n}, acc.options().dtype(bf16_out ? torch::kBFloat16 : torch::kFloat32));
  const bool in_bf16 = acc.scalar_type() == torch::kBFloat16;
  const uint16_t* ab = in_bf16 ? reinterpret_cast<const uint16_t*>(acc.data_ptr()) : nullptr;
  const float* af = in_bf16 ? nullptr : acc.data_ptr<float>();
  uint16_t* ob = bf16_out ? reinterpret_cast<uint16_t*>(out.data_ptr()) : nullptr;
  float* of = bf16_out ? nullptr : out.data_ptr<float>();
  std::atomic<bool> bad{false};
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    unsigned local_bad = 0;
    for (int64_t r = r0; r < r1; ++r) {
      const float a = alpha_p[per_row ? r : 0];
      if (in_bf16 && bf16_out) local_bad |= epilogue_row(ab + r * n, ob + r * n, bp, a, n);
      else if (in_bf16) local_bad |= epilogue_row(ab + r * n, of + r * n, bp, a, n);
      else if (bf16_out) local_bad |= epilogue_row(af + r * n, ob + r * n, bp, a, n);
      else local_bad |= epilogue_row(af + r * n, of + r * n, bp, a, n);
    }
    if (local_bad) bad = true;
  });
  return {out, torch::full({}, bad.load(), acc.options().dtype(torch::kBool))};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("encode_nearest", &encode_nearest);
  mod.def("decode", &decode);
  mod.def("encode_values", &encode_values);
  mod.def("encode_stochastic", &encode_stochastic);
  mod.def("block_scales", &block_scales);
  mod.def("quantize_operand", &quantize_operand);
  mod.def("quantize_operand_grouped", &quantize_operand_grouped);
  mod.def("epilogue", &epilogue);
}
