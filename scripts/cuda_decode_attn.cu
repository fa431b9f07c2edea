// A decode attention written in CUDA, for scripts/cuda_decode_probe.py: what a kernel whose
// layouts Triton does not choose gives at batch 32, measured before anything is adopted.
//
// One CTA per (request, KV head), NW warps, no context splits (batch 32 x 8 KV heads = 256 CTAs,
// two per SM).  Each warp walks every NW-th 16-token block of the request's cached context,
// copying its K and V rows (128 B each) into the warp's own shared-memory stages with cp.async:
// DEPTH - 1 blocks in flight ahead of the one in use, the first PRE of them issued before the
// PDL wait (they do not depend on the qkv matmul).  After the wait, the CTA merges the new
// token's q/k/v from the qkv matmul's fp32 split partials, rotates q and k, writes k and v to the
// cache (bit for bit what pprun's Triton kernel writes) and scores the new token.  Per block,
// S = Q K^T and O += P V are mma.sync m16n8k16 on ldmatrix fragments from a swizzled tile (Q's 4
// heads padded to 16 rows), P handed from S's accumulators to the A fragment in registers:
// ~120 instructions per 16-token block per warp, no barrier in the loop.  The warps'
// online-softmax states are merged once at the end, through shared memory.
// Measured (eighteenth session, docs/performance.md): at batch 32, context 560, 8 warps, 3
// stages, 2 before the wait took 12.9 us alone against the Triton kernel's 14.6, and 20.0 us
// behind the qkv matmul against 21.2.  A form that scored by FMAs and lane shuffles (~5x the
// instructions per token; 17.4-23.1 us alone) was measured and removed (it is in fdf3b1e).
#include <cuda_bf16.h>
#include <stdint.h>

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#define BLOCK 16          // tokens per KV-cache block
#define GROUP 4           // query heads per KV head

struct DecodeArgs {
  const float* parts;      // [P, T, width] fp32 split-K partials of the qkv matmul
  const __nv_bfloat16* bias;  // [width] or null
  int num_parts;
  int width;               // (H + 2 * KVH) * HEAD_DIM
  long part_stride;        // T * width
  const float* cos_t;      // [max_pos, HEAD_DIM] fp32, or null (no rotary)
  const float* sin_t;
  const long* positions;   // [T]
  const long* slots;       // [T]
  __nv_bfloat16* cache;    // [2, num_blocks, BLOCK, KVH, HEAD_DIM]
  long v_offset;           // elements from K to V in the cache
  const int* block_table;  // [R, max_blocks]
  int bt_stride;
  const int* seq_lens;     // [R]
  __nv_bfloat16* out;      // [T, H, HEAD_DIM]
  int num_kv_heads;
  float scale_log2;
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" :: : "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ float bf16r(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// One q/k/v element of token `tok`, column `col`: the partials merged in split order from zero,
// plus the bias, rounded once to bf16 (what the matmul's own merge writes).
__device__ __forceinline__ float merged_act(const DecodeArgs& a, int tok, int col) {
  const float* p = a.parts + (long)tok * a.width + col;
  float total = 0.0f + p[0];
  for (int s = 1; s < a.num_parts; ++s) total = __fadd_rn(total, p[s * a.part_stride]);
  if (a.bias) total = __fadd_rn(total, __bfloat162float(a.bias[col]));
  return bf16r(total);
}

// x * cos + rotate_half(x) * sin, each product and the sum rounded to bf16 (no fma).
__device__ __forceinline__ float rope(float x, float partner, int d, float c, float s) {
  float rot = d < HEAD_DIM / 2 ? -partner : partner;
  float p1 = bf16r(__fmul_rn(x, bf16r(c)));
  float p2 = bf16r(__fmul_rn(rot, bf16r(s)));
  return bf16r(__fadd_rn(p1, p2));
}

// The new token (after the PDL wait): q of the group's heads, k and v merged from the
// partials, q and k rotated, k and v written to the cache, and its score for each head.
// raw: (GROUP + 2) * HEAD_DIM (v is read from it later), qr: GROUP * HEAD_DIM, kr: HEAD_DIM.
template <int NW>
__device__ __forceinline__ void new_token(const DecodeArgs& a, int r, int g, float* raw, float* qr, float* kr,
                                          float* s_new) {
  static_assert(NW >= GROUP, "one warp per head scores the new token");
  const int KVH = a.num_kv_heads, H = KVH * GROUP;
  const long row_stride = (long)KVH * HEAD_DIM;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < (GROUP + 2) * HEAD_DIM; i += NW * 32) {
    int col;
    if (i < GROUP * HEAD_DIM) col = (g * GROUP) * HEAD_DIM + i;
    else if (i < (GROUP + 1) * HEAD_DIM) col = H * HEAD_DIM + g * HEAD_DIM + (i - GROUP * HEAD_DIM);
    else col = (H + KVH) * HEAD_DIM + g * HEAD_DIM + (i - (GROUP + 1) * HEAD_DIM);
    raw[i] = merged_act(a, r, col);
  }
  __syncthreads();
  const long pos = a.positions[r];
  for (int i = threadIdx.x; i < (GROUP + 1) * HEAD_DIM; i += NW * 32) {
    const int d = i % HEAD_DIM;
    float x = raw[i];
    if (a.cos_t) {
      const float partner = raw[i - d + ((d + HEAD_DIM / 2) % HEAD_DIM)];
      x = rope(x, partner, d, a.cos_t[pos * HEAD_DIM + d], a.sin_t[pos * HEAD_DIM + d]);
    }
    if (i < GROUP * HEAD_DIM) qr[i] = x;
    else kr[d] = x;
  }
  __syncthreads();
  const long slot = a.slots[r];
  if (slot >= 0) {
    for (int d = threadIdx.x; d < 2 * HEAD_DIM; d += NW * 32) {
      const long at = slot * row_stride + (long)g * HEAD_DIM + d % HEAD_DIM;
      if (d < HEAD_DIM) a.cache[at] = __float2bfloat16_rn(kr[d]);
      else a.cache[at + a.v_offset] = __float2bfloat16_rn(raw[(GROUP + 1) * HEAD_DIM + d - HEAD_DIM]);
    }
  }
  if (warp < GROUP) {
    float sc = qr[warp * HEAD_DIM + lane] * kr[lane] + qr[warp * HEAD_DIM + lane + 32] * kr[lane + 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o);
    if (lane == 0) s_new[warp] = sc * a.scale_log2;
  }
}

// The warps' (running max, sum, accumulator) per head merged with the new token's, divided out
// and written as bf16.  Call after a __syncthreads that follows the warps' stores.
template <int NW>
__device__ __forceinline__ void merge_warps(const DecodeArgs& a, int r, int g, const float* raw, const float* s_new,
                                            const float (*wm)[GROUP], const float (*wl)[GROUP],
                                            const float (*wacc)[GROUP][HEAD_DIM]) {
  const int H = a.num_kv_heads * GROUP;
  for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += NW * 32) {
    const int h = i / HEAD_DIM, d = i % HEAD_DIM;
    float mt = s_new[h];
#pragma unroll
    for (int w = 0; w < NW; ++w) mt = fmaxf(mt, wm[w][h]);
    float pn = exp2f(s_new[h] - mt);
    float total = pn;
    float o = bf16r(pn) * raw[(GROUP + 1) * HEAD_DIM + d];
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      float ww = wm[w][h] == -INFINITY ? 0.0f : exp2f(wm[w][h] - mt);
      total += wl[w][h] * ww;
      o += wacc[w][h][d] * ww;
    }
    a.out[((long)r * H + g * GROUP + h) * HEAD_DIM + d] = __float2bfloat16_rn(o / total);
  }
}

template <int NW>
__device__ __forceinline__ void zero_row(const DecodeArgs& a, int r, int g) {
  for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += NW * 32)
    a.out[((long)r * a.num_kv_heads * GROUP + g * GROUP) * HEAD_DIM + i] = __float2bfloat16_rn(0.0f);
}

// ---------------------------------------------------------------------------------------------
// The kernel: per 16-token block, S = Q K^T and O += P V as mma.sync m16n8k16 (bf16 in, fp32
// accumulate; Q's 4 heads padded to 16 rows), K and V fragments by ldmatrix from a swizzled
// shared-memory tile, P passed from S's accumulator registers straight into the A fragment.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void ldsm_x4(unsigned* r, const void* smem) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s) : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(unsigned* r, const void* smem) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s) : "memory");
}
// d += a * b, m16n8k16, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma16816(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                         unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}
// A 16-token x 64-dim tile in shared memory: row t's 16-byte chunk c at chunk (c ^ (t % 8)), so
// that ldmatrix's 8 rows of one chunk column fall in 8 different bank groups.
__device__ __forceinline__ int swz(int t, int c) { return t * 8 + (c ^ (t & 7)); }

template <int NW, int DEPTH, int PRE>
__global__ void __launch_bounds__(NW * 32) decode_attn_kernel(DecodeArgs a) {
  static_assert(HEAD_DIM == 64, "fragments assume 64 dims");
  static_assert(PRE < DEPTH, "the PRE blocks issued before the wait are among the DEPTH - 1 ahead");
  const int g = blockIdx.x, r = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int KVH = a.num_kv_heads;

  // stage[warp][depth][K or V][16 rows x 8 chunks], 16 B each, swizzled: NW * DEPTH * 4 KB.
  extern __shared__ uint4 stage_mem[];
  auto stage = reinterpret_cast<uint4(*)[DEPTH][2][BLOCK * 8]>(stage_mem);
  __shared__ float raw[(GROUP + 2) * HEAD_DIM], qr[GROUP * HEAD_DIM], kr[HEAD_DIM], s_new[GROUP];
  __shared__ float wm[NW][GROUP], wl[NW][GROUP], wacc[NW][GROUP][HEAD_DIM];

  const int seq_len = a.seq_lens[r];
  const int n_cached = seq_len > 0 ? seq_len - 1 : 0;
  const int nb = (n_cached + BLOCK - 1) / BLOCK;
  const int cnt = warp < nb ? (nb - warp + NW - 1) / NW : 0;
  const int* bt = a.block_table + (long)r * a.bt_stride;
  const long row_stride = (long)KVH * HEAD_DIM;

  auto issue = [&](int i) {
    if (i < cnt) {
      const int b = warp + i * NW;
      const long phys = bt[b];
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // 128 chunks of K (and of V): row t = idx / 8, chunk c = idx % 8
        const int idx = lane + 32 * j, t = idx / 8, c = idx % 8;
        const bool valid = b * BLOCK + t < n_cached;
        const __nv_bfloat16* src = a.cache + (phys * BLOCK + t) * row_stride + (long)g * HEAD_DIM + c * 8;
        cp_async16(&stage[warp][i % DEPTH][0][swz(t, c)], src, valid);
        cp_async16(&stage[warp][i % DEPTH][1][swz(t, c)], src + a.v_offset, valid);
      }
    }
    cp_async_commit();
  };

#pragma unroll
  for (int i = 0; i < PRE; ++i) issue(i);
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#pragma unroll
  for (int i = PRE; i < DEPTH - 1; ++i) issue(i);
  if (seq_len <= 0) {
    zero_row<NW>(a, r, g);
    cp_async_wait<0>();
    return;
  }
  new_token<NW>(a, r, g, raw, qr, kr, s_new);

  // Q's A fragments (rows = heads; rows 4..15 are zero): per 16-dim chunk kc, a0 = row lane/4,
  // dims kc*16 + (lane%4)*2 +{0,1}; a2 = the same + 8; a1 = a3 = rows 8..15 = 0.
  const int qrow = lane / 4, qcol = (lane % 4) * 2;
  unsigned qa0[4], qa2[4];
#pragma unroll
  for (int kc = 0; kc < 4; ++kc) {
    if (qrow < GROUP) {
      const float* qp = qr + qrow * HEAD_DIM + kc * 16 + qcol;
      qa0[kc] = pack_bf16(qp[0], qp[1]);
      qa2[kc] = pack_bf16(qp[8], qp[9]);
    } else {
      qa0[kc] = qa2[kc] = 0u;
    }
  }
  float m = -INFINITY, l = 0.0f;  // this lane's row (head lane/4): running max, its own share of the sum
  float o[8][4];                  // O accumulator fragments, one per 8-dim column tile
#pragma unroll
  for (int dt = 0; dt < 8; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[dt][e] = 0.0f;

  for (int i = 0; i < cnt; ++i) {
    __syncwarp();
    issue(i + DEPTH - 1);
    cp_async_wait<DEPTH - 1>();
    __syncwarp();  // other lanes' copies into this stage are visible
    const int b = warp + i * NW;
    const uint4* kt = stage[warp][i % DEPTH][0];
    const uint4* vt = stage[warp][i % DEPTH][1];
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // matrices: tokens nt*8 + lane%8, chunks half*4 + lane/8 -> b0,b1 of kc = 2*half, 2*half+1
        unsigned kb[4];
        ldsm_x4(kb, &kt[swz(nt * 8 + lane % 8, half * 4 + lane / 8)]);
        mma16816(s[nt], qa0[2 * half], 0u, qa2[2 * half], 0u, kb[0], kb[1]);
        mma16816(s[nt], qa0[2 * half + 1], 0u, qa2[2 * half + 1], 0u, kb[2], kb[3]);
      }
    // s[nt][0..1]: head lane/4, tokens nt*8 + (lane%4)*2 + {0,1}; s[nt][2..3]: padding rows.
    float mb = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool valid = b * BLOCK + nt * 8 + qcol + e < n_cached;
        s[nt][e] = valid ? s[nt][e] * a.scale_log2 : -INFINITY;
        mb = fmaxf(mb, s[nt][e]);
      }
    mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, 1));
    mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, 2));
    const float m_new = fmaxf(m, mb);  // finite: every block holds a visible token
    const float alpha = exp2f(m - m_new);
    m = m_new;
    float p[2][2];
    float psum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        p[nt][e] = exp2f(s[nt][e] - m_new);
        psum += p[nt][e];
      }
    l = l * alpha + psum;
#pragma unroll
    for (int dt = 0; dt < 8; ++dt) {
      o[dt][0] *= alpha;
      o[dt][1] *= alpha;
    }
    const unsigned pa0 = pack_bf16(p[0][0], p[0][1]), pa2 = pack_bf16(p[1][0], p[1][1]);
#pragma unroll
    for (int dp = 0; dp < 4; ++dp) {
      // matrices: tokens (mi%2)*8 + lane%8, chunk dp*2 + mi/2 (mi = lane/8), transposed
      unsigned vb[4];
      const int mi = lane / 8;
      ldsm_x4_t(vb, &vt[swz((mi % 2) * 8 + lane % 8, dp * 2 + mi / 2)]);
      mma16816(o[2 * dp], pa0, 0u, pa2, 0u, vb[0], vb[1]);
      mma16816(o[2 * dp + 1], pa0, 0u, pa2, 0u, vb[2], vb[3]);
    }
  }
  cp_async_wait<0>();
  // The row's sum over its 4 lanes; lanes of rows 0..3 store the warp's state.
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (qrow < GROUP) {
    if (lane % 4 == 0) {
      wm[warp][qrow] = cnt > 0 ? m : -INFINITY;
      wl[warp][qrow] = cnt > 0 ? l : 0.0f;
    }
#pragma unroll
    for (int dt = 0; dt < 8; ++dt) {
      wacc[warp][qrow][dt * 8 + qcol] = o[dt][0];
      wacc[warp][qrow][dt * 8 + qcol + 1] = o[dt][1];
    }
  }
  __syncthreads();
  merge_warps<NW>(a, r, g, raw, s_new, wm, wl, wacc);
}
