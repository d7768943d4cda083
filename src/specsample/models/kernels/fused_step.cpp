// The fused forward of our Llama runtime on AVX-512 CPUs: every decoder layer of a cached forward in one native call
// (models/fused.py). A layer is RMSNorm -> QKV projection -> RoPE and the cache write -> attention over the cache ->
// output projection added to the residual stream -> RMSNorm -> gate/up projection -> SiLU(gate) * up -> down
// projection added to the residual stream, with the projections in quant_core.h (int4, int8 or bfloat16 weights).
// The torch path runs ~30 small ops per layer, each paying the dispatcher and an allocation; here the small ops run
// in place between the projections.
//
// The rows of a call are b cache rows with n new tokens each: a causal block (a decode step is n = 1), or a token
// tree per row (`parents [b, n]`, -1 for a root): token i sees the row's cached context and its ancestors, at the
// position of its depth; its cache entry sits at its index in the block (the caller keeps a path afterwards).
//
// Invariant: every query's attention is computed over the list of keys it sees, in cache order, by the same
// sequence of operations whatever the other queries of the call, and the projections keep their row invariance
// (quant_core.h), so a position scored in a block of n tokens (or a tree) gets bitwise the hidden states and cache
// entries a one-token step at that position gives.
//
// Activations are bfloat16 between the steps of a layer, as in the torch path; norms, RoPE, softmax and SiLU run in
// float32 and round once.

#include <torch/custom_class.h>
#include <torch/library.h>

#include <cmath>

#include "quant_core.h"

namespace {

using specsample::bf16;
using specsample::Weight;

// exp(x) for float32 lanes: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p of degree 6 (relative error ~2e-7);
// lanes below -87 give 0
inline __m512 exp512(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  __m512 clamped = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, clamped);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  __m512 out = _mm512_scalef_ps(p, n);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), out);
}

// The 16 horizontal sums of acc[0..15], lane i = sum of acc[i]'s lanes. Each lane is summed by the same pattern
// whatever its position, so a key's score does not depend on the keys beside it.
inline __m512 sums16(const __m512 acc[16]) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                             _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

struct Projection {
  std::vector<Weight> parts;  // outputs concatenated in order
  std::vector<at::Tensor> held;
  at::Tensor bias;  // [n] float32, or undefined
  int64_t n = 0, k = 0;
};

struct Layer {
  at::Tensor input_norm, post_norm;  // [hidden] float32
  Projection qkv, o, gate_up, down;
};

constexpr int64_t KEY_CHUNK = 256;  // keys per attention task (a multiple of 32): long contexts spread over threads

class FusedStack : public torch::CustomClassHolder {
 public:
  FusedStack(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps,
             double rope_scale, at::Tensor inv_freq, at::Tensor final_norm)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), intermediate_(intermediate),
        eps_(eps), rope_scale_(rope_scale) {
    TORCH_CHECK(head_dim % 32 == 0 && head_dim <= 128, "the fused step needs a head size that is a multiple of 32, "
                "at most 128");
    TORCH_CHECK(hidden % 32 == 0 && intermediate % 32 == 0, "the fused step needs widths that are multiples of 32");
    TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv_heads");
    inv_freq_ = inv_freq.to(at::kFloat).contiguous();
    TORCH_CHECK(inv_freq_.numel() == head_dim / 2, "inv_freq must hold head_dim / 2 frequencies");
    final_norm_ = final_norm.to(at::kFloat).contiguous();
  }

  // A new layer with its norms; its projections follow as parts (add_part).
  void add_layer(at::Tensor input_norm, at::Tensor post_norm) {
    Layer layer;
    layer.input_norm = input_norm.to(at::kFloat).contiguous();
    layer.post_norm = post_norm.to(at::kFloat).contiguous();
    layers_.push_back(std::move(layer));
  }

  // Appends a part to projection `which` (0 qkv, 1 o, 2 gate_up, 3 down) of the last layer: kind 0 int4 (a codes,
  // b scales_zeros in our layout: quant_core.h), 1 int8 (a codes [n, k], b scales bfloat16 [n]), 2 bfloat16 (a the
  // weight [n, k]). `bias`: the part's bias (empty for none).
  void add_part(int64_t which, int64_t kind, at::Tensor a, at::Tensor b, int64_t group, at::Tensor bias) {
    TORCH_CHECK(!layers_.empty() && which >= 0 && which < 4, "add_layer first, and which in 0..3");
    Layer& layer = layers_.back();
    Projection* projection[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    Projection& p = *projection[which];
    Weight w;
    w.kind = static_cast<Weight::Kind>(kind);
    TORCH_CHECK(a.is_contiguous() && (!b.defined() || b.is_contiguous()), "weights must be contiguous");
    if (w.kind == Weight::INT4) {
      w = specsample::int4_weight(a, group, b);
    } else if (w.kind == Weight::INT8) {
      TORCH_CHECK(a.scalar_type() == at::kChar && b.scalar_type() == at::kBFloat16, "bad int8 dtypes");
      w.n = a.size(0), w.k = a.size(1);
      TORCH_CHECK(b.numel() == w.n, "bad int8 scales");
      w.int8_codes = a.data_ptr<int8_t>();
      w.int8_scales = b.data_ptr<bf16>();
    } else {
      TORCH_CHECK(kind == Weight::BF16 && a.scalar_type() == at::kBFloat16, "bad weight kind or dtype");
      w.n = a.size(0), w.k = a.size(1);
      w.dense = a.data_ptr<bf16>();
    }
    specsample::check_weight(w);
    TORCH_CHECK(p.parts.empty() || p.k == w.k, "the parts of a projection must read the same inputs");
    p.k = w.k;
    p.held.push_back(a);
    if (b.defined()) p.held.push_back(b);
    at::Tensor part_bias = bias.numel() ? bias.to(at::kFloat) : at::zeros({w.n}, at::kFloat);
    if (bias.numel() || p.bias.defined()) {
      if (!p.bias.defined()) p.bias = at::zeros({p.n}, at::kFloat);
      p.bias = at::cat({p.bias, part_bias}).contiguous();
    }
    p.n += w.n;
    p.parts.push_back(w);
  }

  // Hidden states after appending `x [b, n, hidden]` (bfloat16 embeddings) to cache rows `slots [b]` from positions
  // `starts [b]`: the final-normed hidden states [b, n, hidden], and the residual streams entering each of
  // `feature_layers` concatenated [b, n, len * hidden] (empty where none). `parents [b, n]` (int64, -1 for a root)
  // makes the block a tree per row; an empty tensor, a causal block. `flat_keys`, `flat_values`: the KVCache's
  // [1 + layers * num_slots, kv_heads, max_len, head_dim] stores.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, at::Tensor flat_keys, at::Tensor flat_values,
                                             at::Tensor slots, at::Tensor starts, int64_t num_slots, at::Tensor parents,
                                             std::vector<int64_t> feature_layers) {
    TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kBFloat16 && x.size(2) == hidden_, "x must be [b, n, hidden]");
    TORCH_CHECK(flat_keys.scalar_type() == at::kBFloat16 && flat_values.scalar_type() == at::kBFloat16 &&
                    flat_keys.is_contiguous() && flat_values.is_contiguous(), "the cache must be contiguous bfloat16");
    const int64_t batch = x.size(0), n = x.size(1), m = batch * n;
    const int64_t max_len = flat_keys.size(2);
    TORCH_CHECK(flat_keys.size(0) == 1 + static_cast<int64_t>(layers_.size()) * num_slots &&
                    flat_keys.size(1) == kv_heads_ && flat_keys.size(3) == head_dim_, "the cache does not fit");
    auto slot_list = slots.to(at::kLong).contiguous();
    auto start_list = starts.to(at::kLong).contiguous();
    const int64_t* slot_of = slot_list.data_ptr<int64_t>();
    const int64_t* start_of = start_list.data_ptr<int64_t>();
    for (int64_t r = 0; r < batch; ++r)
      TORCH_CHECK(slot_of[r] >= 0 && slot_of[r] < num_slots && start_of[r] >= 0 && start_of[r] + n <= max_len,
                  "a row's slot or positions fall outside the cache");

    // the keys each new token sees among the block (visible[r][i * n + j]) and its RoPE position
    std::vector<uint8_t> visible(batch * n * n, 0);
    std::vector<int64_t> positions(m);
    if (parents.numel()) {
      auto parent_list = parents.to(at::kLong).contiguous();
      TORCH_CHECK(parent_list.numel() == m, "parents must be [b, n]");
      const int64_t* parent = parent_list.data_ptr<int64_t>();
      for (int64_t r = 0; r < batch; ++r) {
        std::vector<int64_t> depth(n, 0);
        uint8_t* seen = visible.data() + r * n * n;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t p = parent[r * n + i];
          TORCH_CHECK(p >= -1 && p < i, "token ", i, "'s parent must come before it (or be -1), got ", p);
          if (p >= 0) {
            std::memcpy(seen + i * n, seen + p * n, n);
            depth[i] = depth[p] + 1;
          }
          seen[i * n + i] = 1;
          positions[r * n + i] = start_of[r] + depth[i];
        }
      }
    } else {
      for (int64_t r = 0; r < batch; ++r)
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t j = 0; j <= i; ++j) visible[(r * n + i) * n + j] = 1;
          positions[r * n + i] = start_of[r] + i;
        }
    }
    // RoPE tables [m, head_dim / 2] (angles in float32, as rope_tables computes them)
    const int64_t half = head_dim_ / 2;
    std::vector<float> cosines(m * half), sines(m * half);
    const float* freq = inv_freq_.data_ptr<float>();
    for (int64_t t = 0; t < m; ++t)
      for (int64_t j = 0; j < half; ++j) {
        const float angle = static_cast<float>(positions[t]) * freq[j];
        cosines[t * half + j] = std::cos(angle) * static_cast<float>(rope_scale_);
        sines[t * half + j] = std::sin(angle) * static_cast<float>(rope_scale_);
      }

    auto stream = x.contiguous().clone();  // [m, hidden] the residual stream
    bf16* residual = stream.data_ptr<bf16>();
    const int64_t wanted = feature_layers.size();
    at::Tensor features = wanted ? at::empty({batch, n, wanted * hidden_}, x.options()) : at::empty({0}, x.options());
    const int64_t qkv_width = (heads_ + 2 * kv_heads_) * head_dim_;
    std::vector<bf16> normed(m * std::max(hidden_, intermediate_));
    std::vector<float> wide(m * std::max(qkv_width, 2 * intermediate_));
    std::vector<bf16> queries(m * heads_ * head_dim_), attended(m * heads_ * head_dim_);
    std::vector<float> sums(m * std::max({hidden_, heads_ * head_dim_, intermediate_}) / 16);
    bf16* key_store = flat_keys.data_ptr<bf16>();
    bf16* value_store = flat_values.data_ptr<bf16>();
    const int64_t row_stride = kv_heads_ * max_len * head_dim_;  // one (layer, slot) of the cache

    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      take_features(feature_layers, l, residual, features, m);
      rms_norm(residual, layer.input_norm.data_ptr<float>(), normed.data(), m);
      project_to(layer.qkv, normed.data(), m, sums.data(), [&](int64_t r, int64_t j, float v) {
        wide[r * qkv_width + j] = v;
      });
      // RoPE on q and k; k and v into the cache at their block positions, q kept for attention
      for (int64_t t = 0; t < m; ++t) {
        const int64_t row = t / n, i = t % n;
        const float* c = cosines.data() + t * half;
        const float* s = sines.data() + t * half;
        const float* source = wide.data() + t * qkv_width;
        bf16* cache_row = key_store + (1 + l * num_slots + slot_of[row]) * row_stride;
        bf16* value_row = value_store + (1 + l * num_slots + slot_of[row]) * row_stride;
        const int64_t position = start_of[row] + i;
        for (int64_t h = 0; h < heads_ + kv_heads_; ++h) {
          const float* head = source + h * head_dim_;
          bf16* out = h < heads_ ? queries.data() + (t * heads_ + h) * head_dim_
                                 : cache_row + ((h - heads_) * max_len + position) * head_dim_;
          for (int64_t j = 0; j < half; ++j) {
            out[j] = bf16(head[j] * c[j] - head[j + half] * s[j]);
            out[j + half] = bf16(head[j + half] * c[j] + head[j] * s[j]);
          }
        }
        for (int64_t h = 0; h < kv_heads_; ++h) {
          const float* head = source + (heads_ + kv_heads_ + h) * head_dim_;
          bf16* out = value_row + (h * max_len + position) * head_dim_;
          for (int64_t j = 0; j < head_dim_; ++j) out[j] = bf16(head[j]);
        }
      }
      if (specsample::amx_enabled())
        attend_amx(l, num_slots, batch, n, max_len, slot_of, start_of, visible.data(), queries.data(), key_store,
                   value_store, attended.data());
      else
        attend(l, num_slots, batch, n, max_len, slot_of, start_of, visible.data(), queries.data(), key_store,
               value_store, attended.data());
      project_to(layer.o, attended.data(), m, sums.data(), [&](int64_t r, int64_t j, float v) {
        bf16& x_rj = residual[r * hidden_ + j];
        x_rj = bf16(static_cast<float>(x_rj) + v);
      });
      rms_norm(residual, layer.post_norm.data_ptr<float>(), normed.data(), m);
      const int64_t width = 2 * intermediate_;
      project_to(layer.gate_up, normed.data(), m, sums.data(), [&](int64_t r, int64_t j, float v) {
        wide[r * width + j] = v;
      });
      swiglu(wide.data(), normed.data(), m);
      project_to(layer.down, normed.data(), m, sums.data(), [&](int64_t r, int64_t j, float v) {
        bf16& x_rj = residual[r * hidden_ + j];
        x_rj = bf16(static_cast<float>(x_rj) + v);
      });
    }
    take_features(feature_layers, layers_.size(), residual, features, m);
    auto out = at::empty({batch, n, hidden_}, x.options());
    rms_norm(residual, final_norm_.data_ptr<float>(), out.data_ptr<bf16>(), m);
    return {out, features};
  }

  int64_t num_layers() const { return layers_.size(); }

 private:
  void take_features(const std::vector<int64_t>& wanted, int64_t layer, const bf16* residual, at::Tensor& features,
                     int64_t m) const {
    for (size_t f = 0; f < wanted.size(); ++f)
      if (wanted[f] == layer) {
        bf16* dst = features.data_ptr<bf16>();
        for (int64_t t = 0; t < m; ++t)
          std::memcpy(dst + (t * wanted.size() + f) * hidden_, residual + t * hidden_, hidden_ * sizeof(bf16));
      }
  }

  // out [m, hidden] = x / rms(x) * weight, per row in float32, rounded once
  void rms_norm(const bf16* x, const float* weight, bf16* out, int64_t m) const {
    for (int64_t t = 0; t < m; ++t) {
      __m512 squares = _mm512_setzero_ps();
      for (int64_t j = 0; j < hidden_; j += 16) {
        __m512 v = specsample::load_bf16(x + t * hidden_ + j);
        squares = _mm512_fmadd_ps(v, v, squares);
      }
      const float inverse = 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / hidden_ + static_cast<float>(eps_));
      const __m512 scale = _mm512_set1_ps(inverse);
      for (int64_t j = 0; j < hidden_; j += 16) {
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(specsample::load_bf16(x + t * hidden_ + j), scale),
                                 _mm512_loadu_ps(weight + j));
        specsample::store_bf16(out + t * hidden_ + j, v);
      }
    }
  }

  // out [m, intermediate] = silu(gate) * up from wide [m, 2 * intermediate] (gate, then up)
  void swiglu(const float* wide, bf16* out, int64_t m) const {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t t = 0; t < m; ++t) {
      const float* gate = wide + t * 2 * intermediate_;
      const float* up = gate + intermediate_;
      for (int64_t j = 0; j < intermediate_; j += 16) {
        __m512 g = _mm512_loadu_ps(gate + j);
        __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        specsample::store_bf16(out + t * intermediate_ + j, _mm512_mul_ps(silu, _mm512_loadu_ps(up + j)));
      }
    }
  }

  // every output of a projection, bias added, handed to `take(row, column, value)`
  template <class Take>
  void project_to(const Projection& p, const bf16* x, int64_t m, float* sums, Take&& take) const {
    const float* bias = p.bias.defined() ? p.bias.data_ptr<float>() : nullptr;
    int64_t offset = 0;
    for (const Weight& w : p.parts) {
      specsample::project(x, m, w, sums, [&](int64_t r, int64_t j0, int64_t width, const float* values) {
        for (int64_t i = 0; i < width; ++i) {
          const int64_t j = offset + j0 + i;
          take(r, j, bias ? values[i] + bias[j] : values[i]);
        }
      }, true);
      offset += w.n;
    }
  }

  // Attention on AMX tiles. The keys of a row split into chunks of KEY_CHUNK at fixed positions; one task per (row, kv
  // head, chunk), which computes the chunk's part for each block of up to 16 of the head's query rows
  // r = i * groups + g in turn (the chunk's keys and values read from memory once, then from the core's caches): scores
  // S^T = K Q^T 16 keys at a time, a softmax per query row within the chunk (the keys it does not see weigh exactly
  // 0), O = P V 32 keys at a time; then each query row's chunks merge in order (flash-decoding), so a long context's
  // keys spread over the threads. A key's score, a weight-0 key's term and a chunk's result do not depend on the other
  // queries or keys of the call, so a causal block scores each position bitwise as a one-token step does; a tree's
  // token gets its path's chain result to rounding.
  void attend_amx(int64_t layer, int64_t num_slots, int64_t batch, int64_t n, int64_t max_len, const int64_t* slot_of,
                  const int64_t* start_of, const uint8_t* visible, const bf16* queries, const bf16* key_store,
                  const bf16* value_store, bf16* out) const {
    const int64_t groups = heads_ / kv_heads_, hd = head_dim_, steps = hd / 32;
    const int64_t query_rows = groups * n, blocks = (query_rows + 15) / 16;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    const int64_t row_stride = kv_heads_ * max_len * hd;
    int64_t chunks32 = 0;  // 32-key steps of the longest row
    for (int64_t row = 0; row < batch; ++row) chunks32 = std::max(chunks32, (start_of[row] + n + 31) / 32);
    const int64_t key_chunks = (chunks32 * 32 + KEY_CHUNK - 1) / KEY_CHUNK;
    // each (block, chunk)'s partial result per query row: its chunk's max score, weight sum and unnormalised output
    const int64_t partial = hd + 2;
    std::vector<float> partials(batch * kv_heads_ * blocks * key_chunks * 16 * partial);
    specsample::parallel_for(0, batch * kv_heads_ * key_chunks, 1, [&](int64_t begin, int64_t end) {
      alignas(64) bf16 query_pairs[4 * 16 * 32];  // B tiles of Q^T: [step][dim pair][query row][2]
      alignas(64) float score_tile[16 * 16];
      alignas(64) bf16 value_tiles[4 * 16 * 32];  // B tiles of V: [16 dims][key pair][dim][2]
      alignas(64) bf16 padded[32 * 128];          // a last, partial step of keys or values, zero beyond the chunk
      alignas(64) float sums_tile[4 * 16 * 16];
      std::vector<float> scores;
      std::vector<bf16> probs;
      // several query blocks: the chunk's values interleaved once for all of them, [32 keys][tiles], zero past the row
      std::vector<bf16> interleaved(blocks > 1 ? (KEY_CHUNK / 32) * (hd / 16) * 512 : 0);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t chunk = task % key_chunks, row_head = task / key_chunks;
        const int64_t row = row_head / kv_heads_, kv_head = row_head % kv_heads_;
        for (int64_t block = 0; block < blocks; ++block) {
          float* results = partials.data() + ((row_head * blocks + block) * key_chunks + chunk) * 16 * partial;
          for (int64_t r = 0; r < 16; ++r) results[r * partial] = -INFINITY;  // no key seen in this chunk
        }
        const int64_t c0 = chunk * KEY_CHUNK, row_total = start_of[row] + n;
        if (c0 >= row_total) continue;
        const int64_t offset = (1 + layer * num_slots + slot_of[row]) * row_stride + kv_head * max_len * hd;
        const bf16* key_base = key_store + offset;
        const bf16* value_base = value_store + offset;
        if (blocks > 1) {
          for (int64_t t0 = c0; t0 < std::min(row_total, c0 + KEY_CHUNK); t0 += 32) {
            const bf16* values = value_base + t0 * hd;
            if (t0 + 32 > row_total) {
              std::memset(padded, 0, sizeof padded);
              std::memcpy(padded, values, (row_total - t0) * hd * sizeof(bf16));
              values = padded;
            }
            interleave_values(values, hd, 0, hd / 16, interleaved.data() + ((t0 - c0) / 32) * (hd / 16) * 512);
          }
        }
        for (int64_t block = 0; block < blocks; ++block) {
          const int64_t r0 = block * 16, rows = std::min<int64_t>(16, query_rows - r0);
          float* results = partials.data() + ((row_head * blocks + block) * key_chunks + chunk) * 16 * partial;
          // the keys these queries see lie before the furthest one they see: the rest weigh 0 and are not read
          const int64_t context = start_of[row];
          int64_t total = context;
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = (r0 + r) / groups;
            for (int64_t j = n - 1; j >= 0; --j)
              if (visible[(row * n + i) * n + j]) {
                total = std::max(total, context + j + 1);
                break;
              }
          }
          const int64_t c1 = std::min(total, c0 + KEY_CHUNK);
          if (c0 >= c1) continue;
          const int64_t span = (c1 - c0 + 31) / 32 * 32;
          auto query = [&](int64_t r) {  // query row r0 + r: token i, head kv_head * groups + g
            const int64_t i = (r0 + r) / groups, g = (r0 + r) % groups;
            return ((row * n + i) * heads_ + kv_head * groups + g) * hd;
          };
          uint32_t* pairs = reinterpret_cast<uint32_t*>(query_pairs);
          for (int64_t r = 0; r < rows; ++r) {
            const uint32_t* q = reinterpret_cast<const uint32_t*>(queries + query(r));
            for (int64_t p = 0; p < hd / 2; ++p) pairs[(p / 16) * 256 + (p % 16) * rows + r] = q[p];
          }
          // scores of the chunk's keys, masked: -inf where the query does not see the key
          scores.assign(rows * span, -INFINITY);
          specsample::TileConfig config;
          config.rows[0] = 16, config.colsb[0] = rows * 4;  // S^T: 16 keys x rows
          config.rows[1] = 16, config.colsb[1] = 64;        // K: 16 keys x 32 dims
          for (int t = 2; t < 2 + steps; ++t) config.rows[t] = 16, config.colsb[t] = rows * 4;  // Q^T per 32 dims
          _tile_loadconfig(&config);
          for (int64_t step = 0; step < steps; ++step) load_tile(2 + step, query_pairs + step * 512, rows * 4);
          const __m512i column =
              _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
          for (int64_t t0 = c0; t0 < c1; t0 += 16) {
            const bf16* keys = key_base + t0 * hd;
            if (t0 + 16 > c1) {
              std::memset(padded, 0, sizeof padded);
              std::memcpy(padded, keys, (c1 - t0) * hd * sizeof(bf16));
              keys = padded;
            }
            _tile_zero(0);
            for (int64_t step = 0; step < steps; ++step) {
              _tile_loadd(1, keys + 32 * step, hd * 2);
              multiply_scores(2 + step);
            }
            _tile_stored(0, score_tile, 64);
            for (int64_t r = 0; r < rows; ++r) {
              const uint8_t* seen = visible + (row * n + (r0 + r) / groups) * n;
              __mmask16 keep = t0 + 16 <= context ? 0xFFFF : 0;  // the keys t0 .. t0 + 15 this query sees
              for (int64_t u = 0; u < 16 && t0 + u < c1 && t0 + 16 > context; ++u)
                if (t0 + u < context || seen[t0 + u - context]) keep |= static_cast<__mmask16>(1u << u);
              if (t0 + 16 > c1) keep &= static_cast<__mmask16>((1u << (c1 - t0)) - 1);
              __m512 row_scores =
                  _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(r)), score_tile, 4);
              _mm512_mask_storeu_ps(scores.data() + r * span + (t0 - c0), keep,
                                    _mm512_mul_ps(row_scores, _mm512_set1_ps(scale)));
            }
          }
          // weights relative to the chunk's best score, rounded to bfloat16, summed as rounded
          probs.assign(rows * span, bf16(0.0f));
          for (int64_t r = 0; r < rows; ++r) {
            const float* row_scores = scores.data() + r * span;
            __m512 best = _mm512_set1_ps(-INFINITY);
            for (int64_t t = 0; t < span; t += 16) best = _mm512_max_ps(best, _mm512_loadu_ps(row_scores + t));
            const float top = _mm512_reduce_max_ps(best);
            results[r * partial] = top;
            if (top == -INFINITY) continue;  // sees none of this chunk's keys
            __m512 sum = _mm512_setzero_ps();
            for (int64_t t = 0; t < span; t += 16) {
              __m512 p = exp512(_mm512_sub_ps(_mm512_loadu_ps(row_scores + t), _mm512_set1_ps(top)));
              __m256bh rounded = _mm512_cvtneps_pbh(p);
              std::memcpy(probs.data() + r * span + t, &rounded, 32);
              sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(rounded));
            }
            results[r * partial + 1] = _mm512_reduce_add_ps(sum);
          }
          // O = P V, 64 dims (4 tiles) at a time
          specsample::TileConfig pv;
          for (int t = 0; t < 4; ++t) pv.rows[t] = rows, pv.colsb[t] = 64;  // O: rows x 16 dims
          pv.rows[4] = rows, pv.colsb[4] = 64;                              // P: rows x 32 keys
          pv.rows[5] = 16, pv.colsb[5] = 64;                                // V: 16 key pairs x 16 dims
          _tile_loadconfig(&pv);
          for (int64_t d0 = 0; d0 < hd; d0 += 64) {
            const int64_t tiles = std::min<int64_t>(4, (hd - d0) / 16);
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t t0 = c0; t0 < c1; t0 += 32) {
              const bf16* tiles_here = value_tiles;
              if (!interleaved.empty()) {
                tiles_here = interleaved.data() + ((t0 - c0) / 32) * (hd / 16) * 512 + (d0 / 16) * 512;
              } else {
                const bf16* values = value_base + t0 * hd;
                if (t0 + 32 > c1) {
                  std::memset(padded, 0, sizeof padded);
                  std::memcpy(padded, values, (c1 - t0) * hd * sizeof(bf16));
                  values = padded;
                }
                interleave_values(values, hd, d0, tiles, value_tiles);
              }
              _tile_loadd(4, probs.data() + (t0 - c0), span * 2);
              for (int64_t j = 0; j < tiles; ++j) {
                _tile_loadd(5, tiles_here + j * 512, 64);
                multiply_values(j);
              }
            }
            _tile_stored(0, sums_tile, 64);
            _tile_stored(1, sums_tile + 256, 64);
            _tile_stored(2, sums_tile + 512, 64);
            _tile_stored(3, sums_tile + 768, 64);
            for (int64_t r = 0; r < rows; ++r)
              for (int64_t j = 0; j < tiles; ++j)
                std::memcpy(results + r * partial + 2 + d0 + 16 * j, sums_tile + j * 256 + r * 16,
                            16 * sizeof(float));
          }
        }
      }
      _tile_release();
    });
    // each query row's chunks merged in chunk order: out = sum_c e^(m_c - M) O_c / sum_c e^(m_c - M) l_c
    specsample::parallel_for(0, batch * kv_heads_ * blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t block_task = begin; block_task < end; ++block_task) {
        const int64_t row = block_task / (kv_heads_ * blocks), kv_head = (block_task / blocks) % kv_heads_;
        const int64_t r0 = (block_task % blocks) * 16, rows = std::min<int64_t>(16, query_rows - r0);
        for (int64_t r = 0; r < rows; ++r) {
          float best = -INFINITY;
          for (int64_t c = 0; c < key_chunks; ++c)
            best = std::max(best, partials[((block_task * key_chunks + c) * 16 + r) * partial]);
          __m512 acc[8];
          for (int64_t v = 0; v < hd / 16; ++v) acc[v] = _mm512_setzero_ps();
          float weight_sum = 0.0f;
          for (int64_t c = 0; c < key_chunks; ++c) {
            const float* result = partials.data() + ((block_task * key_chunks + c) * 16 + r) * partial;
            if (result[0] == -INFINITY) continue;
            const float w = std::exp(result[0] - best);
            weight_sum += w * result[1];
            for (int64_t v = 0; v < hd / 16; ++v)
              acc[v] = _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_loadu_ps(result + 2 + 16 * v), acc[v]);
          }
          const int64_t i = (r0 + r) / groups, g = (r0 + r) % groups;
          bf16* dst = out + ((row * n + i) * heads_ + kv_head * groups + g) * hd;
          const __m512 inverse = _mm512_set1_ps(1.0f / weight_sum);
          for (int64_t v = 0; v < hd / 16; ++v) specsample::store_bf16(dst + 16 * v, _mm512_mul_ps(acc[v], inverse));
        }
      }
    });
  }

  // `tiles` B tiles of 32 keys' values (rows 32 x hd from `values`), dims d0 .. d0 + 16 tiles: tile j row u holds key
  // pair u's two values of dim d0 + 16 j + d interleaved, (v[2u][d], v[2u + 1][d]) for d = 0 .. 15
  static void interleave_values(const bf16* values, int64_t hd, int64_t d0, int64_t tiles, bf16* dst) {
    const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second_half = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t u = 0; u < 16; ++u)
      for (int64_t h = 0; h < tiles / 2; ++h) {
        __m512i a = _mm512_loadu_si512(values + 2 * u * hd + d0 + 32 * h);
        __m512i b = _mm512_loadu_si512(values + (2 * u + 1) * hd + d0 + 32 * h);
        __m512i low = _mm512_unpacklo_epi16(a, b), high = _mm512_unpackhi_epi16(a, b);
        _mm512_storeu_si512(dst + (2 * h) * 512 + u * 32, _mm512_permutex2var_epi32(low, first_half, high));
        _mm512_storeu_si512(dst + (2 * h + 1) * 512 + u * 32, _mm512_permutex2var_epi32(low, second_half, high));
      }
  }

  // tile numbers are immediates: one case per tile the attention uses
  static void load_tile(int64_t tile, const void* data, int64_t stride) {
    switch (tile) {
      case 2: _tile_loadd(2, data, stride); break;
      case 3: _tile_loadd(3, data, stride); break;
      case 4: _tile_loadd(4, data, stride); break;
      default: _tile_loadd(5, data, stride); break;
    }
  }
  static void multiply_scores(int64_t tile) {  // S^T (tile 0) += K (tile 1) x Q^T (tile `tile`)
    switch (tile) {
      case 2: _tile_dpbf16ps(0, 1, 2); break;
      case 3: _tile_dpbf16ps(0, 1, 3); break;
      case 4: _tile_dpbf16ps(0, 1, 4); break;
      default: _tile_dpbf16ps(0, 1, 5); break;
    }
  }
  static void multiply_values(int64_t tile) {  // O (tile `tile`) += P (tile 4) x V (tile 5)
    switch (tile) {
      case 0: _tile_dpbf16ps(0, 4, 5); break;
      case 1: _tile_dpbf16ps(1, 4, 5); break;
      case 2: _tile_dpbf16ps(2, 4, 5); break;
      default: _tile_dpbf16ps(3, 4, 5); break;
    }
  }

  // attention of every query over the keys it sees; one task per (row, head)
  void attend(int64_t layer, int64_t num_slots, int64_t batch, int64_t n, int64_t max_len, const int64_t* slot_of,
              const int64_t* start_of, const uint8_t* visible, const bf16* queries, const bf16* key_store,
              const bf16* value_store, bf16* out) const {
    const int64_t groups = heads_ / kv_heads_, hd = head_dim_, vectors = hd / 16;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    const int64_t row_stride = kv_heads_ * max_len * hd;
    specsample::parallel_for(0, batch * heads_, 1, [&](int64_t begin, int64_t end) {
      std::vector<const bf16*> keys;
      std::vector<float> scores;
      std::vector<bf16> weights, zeros(hd, bf16(0.0f));
      for (int64_t task = begin; task < end; ++task) {
        const int64_t row = task / heads_, head = task % heads_, kv_head = head / groups;
        const int64_t offset = (1 + layer * num_slots + slot_of[row]) * row_stride + kv_head * max_len * hd;
        const bf16* key_base = key_store + offset;
        const bf16* value_base = value_store + offset;
        const int64_t context = start_of[row];
        for (int64_t i = 0; i < n; ++i) {
          keys.clear();  // the keys this query sees, in cache order: the context, then its visible block tokens
          for (int64_t t = 0; t < context; ++t) keys.push_back(key_base + t * hd);
          const uint8_t* seen = visible + (row * n + i) * n;
          for (int64_t j = 0; j < n; ++j)
            if (seen[j]) keys.push_back(key_base + (context + j) * hd);
          const int64_t count = keys.size();
          scores.resize((count + 15) / 16 * 16);
          const bf16* q = queries + ((row * n + i) * heads_ + head) * hd;
          __m512i q_pairs[8];
          for (int64_t v = 0; v < hd / 32; ++v) q_pairs[v] = _mm512_loadu_si512(q + 32 * v);
          __m512 best = _mm512_set1_ps(-INFINITY);
          for (int64_t c = 0; c < count; c += 16) {
            __m512 acc[16];
            for (int64_t u = 0; u < 16; ++u) {
              acc[u] = _mm512_setzero_ps();
              if (c + u < count)
                for (int64_t v = 0; v < hd / 32; ++v)
                  acc[u] = specsample::dot(acc[u], q_pairs[v], _mm512_loadu_si512(keys[c + u] + 32 * v));
            }
            __m512 chunk = _mm512_mul_ps(sums16(acc), _mm512_set1_ps(scale));
            const __mmask16 valid = count - c >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (count - c)) - 1);
            chunk = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, chunk);
            _mm512_storeu_ps(scores.data() + c, chunk);
            best = _mm512_max_ps(best, chunk);
          }
          // softmax weights rounded to bfloat16, in pairs of consecutive keys (a last odd key pairs with zero)
          const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
          __m512 total = _mm512_setzero_ps();
          weights.resize((count + 31) / 32 * 32);
          for (int64_t c = 0; c < count; c += 16) {
            __m512 p = exp512(_mm512_sub_ps(_mm512_loadu_ps(scores.data() + c), top));
            __m256bh rounded = _mm512_cvtneps_pbh(p);
            std::memcpy(weights.data() + c, &rounded, 32);
            total = _mm512_add_ps(total, _mm512_cvtpbh_ps(rounded));
          }
          // out += p_t v_t + p_t+1 v_t+1 per pair of keys: their values interleaved dim by dim, one bfloat16 dot
          // product per 16 dims; lane j of the low (high) half holds dim 8 (j / 4) + j % 4 (+ 4) of its 32 dims
          __m512 low[8], high[8];
          for (int64_t v = 0; v < hd / 32; ++v) low[v] = high[v] = _mm512_setzero_ps();
          const uint32_t* pairs = reinterpret_cast<const uint32_t*>(weights.data());
          for (int64_t t = 0; t < count; t += 2) {
            const __m512i p = _mm512_set1_epi32(static_cast<int>(pairs[t / 2]));
            const bf16* first = value_base + (keys[t] - key_base);
            const bf16* second = t + 1 < count ? value_base + (keys[t + 1] - key_base) : zeros.data();
            for (int64_t v = 0; v < hd / 32; ++v) {
              __m512i a = _mm512_loadu_si512(first + 32 * v), b = _mm512_loadu_si512(second + 32 * v);
              low[v] = specsample::dot(low[v], _mm512_unpacklo_epi16(a, b), p);
              high[v] = specsample::dot(high[v], _mm512_unpackhi_epi16(a, b), p);
            }
          }
          const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
          const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
          const __m512i second_half = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
          __m512 acc[16];
          for (int64_t v = 0; v < hd / 32; ++v) {
            acc[2 * v] = _mm512_permutex2var_ps(low[v], first_half, high[v]);
            acc[2 * v + 1] = _mm512_permutex2var_ps(low[v], second_half, high[v]);
          }
          bf16* dst = out + ((row * n + i) * heads_ + head) * hd;
          for (int64_t v = 0; v < vectors; ++v) specsample::store_bf16(dst + 16 * v, _mm512_mul_ps(acc[v], inverse));
        }
      }
    });
  }

  int64_t hidden_, heads_, kv_heads_, head_dim_, intermediate_;
  double eps_, rope_scale_;
  at::Tensor inv_freq_, final_norm_;
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY(specsample_fused, m) {
  m.class_<FusedStack>("FusedStack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor>())
      .def("add_layer", &FusedStack::add_layer)
      .def("add_part", &FusedStack::add_part)
      .def("num_layers", &FusedStack::num_layers)
      .def("forward", &FusedStack::forward);
}
