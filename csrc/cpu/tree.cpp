// The draft-tree kernels (dflash_kernels.tree's "cpu" bodies; definitions: build_tree_reference,
// tree_ancestor_mask_reference, tree_accept_greedy_tokens_reference, tree_compact_reference, whose results these
// reproduce bit for bit). Integer code: compiled for any x86-64, no ISA of its own.
#include <cmath>
#include <cstring>
#include <functional>
#include <new>
#include <queue>
#include <vector>

#include "dflash_cpu.h"

namespace dflash_cpu {
namespace {

struct Candidate {  // a heap entry, ordered as the reference's tuples (-score, depth, parent, rank)
  double key;
  long depth, parent, rank;
  bool operator>(const Candidate& o) const {
    if (key != o.key) return key > o.key;
    if (depth != o.depth) return depth > o.depth;
    if (parent != o.parent) return parent > o.parent;
    return rank > o.rank;
  }
};

// BuildTreeArgs (dflash_cpu.h); throws std::bad_alloc without memory.
int build_tree_rows(const BuildTreeArgs& a) {
  const float *z = a.z, *lse = a.lse;
  const long ldr = a.ldr, ldp = a.ldp, R = a.R, P = a.P, V = a.V, K = a.K, T = a.T;
  const int64_t *anchor = a.anchor, *vocab_ids = a.vocab_ids;
  int64_t *tokens = a.tokens, *parents = a.parents, *depths = a.depths;
  std::vector<float> lp(P * K);
  std::vector<long> idx(P * K);
  std::vector<float> score(T);
  for (long r = 0; r < R; ++r) {
    for (long p = 0; p < P; ++p) {
      const float* row = z + r * ldr + p * ldp;
      float* vals = &lp[p * K];
      long* ids = &idx[p * K];
      long count = 0;
      for (long j = 0; j < V; ++j) {  // ascending j: an equal value goes after those already kept
        const float v = row[j];
        if (std::isnan(v) || v == INFINITY) return 1;
        if (count == K && !(v > vals[K - 1])) continue;
        long pos = count < K ? count : K - 1;
        while (pos > 0 && vals[pos - 1] < v) {
          vals[pos] = vals[pos - 1];
          ids[pos] = ids[pos - 1];
          --pos;
        }
        vals[pos] = v;
        ids[pos] = j;
        if (count < K) ++count;
      }
      const float norm = lse[r * P + p];
      for (long k = 0; k < K; ++k) vals[k] = vals[k] - norm;
    }
    int64_t* tok = tokens + r * T;
    int64_t* par = parents + r * T;
    int64_t* dep = depths + r * T;
    tok[0] = anchor[r];
    par[0] = -1;
    dep[0] = 0;
    score[0] = 0.f;
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
    heap.push({-(double)(0.f + lp[0]), 1, 0, 0});
    for (long i = 1; i < T; ++i) {
      const Candidate c = heap.top();
      heap.pop();
      score[i] = (float)(-c.key);
      const long j = idx[(c.depth - 1) * K + c.rank];
      tok[i] = vocab_ids ? vocab_ids[j] : j;
      par[i] = c.parent;
      dep[i] = c.depth;
      if (c.rank + 1 < K)
        heap.push({-(double)(score[c.parent] + lp[(c.depth - 1) * K + c.rank + 1]), c.depth, c.parent, c.rank + 1});
      if (c.depth < P) heap.push({-(double)(score[i] + lp[c.depth * K]), c.depth + 1, i, 0});
    }
  }
  return 0;
}

}  // namespace

int build_tree(const BuildTreeArgs& a) {
  try {
    return build_tree_rows(a);
  } catch (const std::bad_alloc&) {  // its vectors' memory
    return 2;
  }
}

long tree_ancestor_mask(const int64_t* parents, long ldr, long R, long T, long W, int64_t* mask) {
  for (long r = 0; r < R; ++r) {
    const int64_t* par = parents + r * ldr;
    uint64_t* m = (uint64_t*)(mask + r * T * W);
    for (long i = 0; i < T; ++i) {
      const int64_t p = par[i];
      if (i == 0 ? p != -1 : (p < 0 || p >= i)) return r * T + i;
      for (long w = 0; w < W; ++w) m[i * W + w] = i == 0 ? 0 : m[p * W + w];
      m[i * W + i / 64] |= (uint64_t)1 << (i % 64);
    }
  }
  return -1;
}

void tree_walk_tokens(const TreeWalkArgs& a) {
  const int64_t *target = a.target, *tokens = a.tokens, *parents = a.parents;
  const long ldt = a.ldt, ldk = a.ldk, ldp = a.ldp, R = a.R, T = a.T, B = a.B;
  int64_t *path = a.path, *accepted = a.accepted, *bonus = a.bonus;
  for (long r = 0; r < R; ++r) {
    const int64_t *tg = target + r * ldt, *tk = tokens + r * ldk, *pr = parents + r * ldp;
    int64_t* p = path + r * B;
    for (long d = 0; d < B; ++d) p[d] = -1;
    long cur = 0, d = 0;
    p[0] = 0;
    for (;;) {
      const int64_t x = tg[cur];
      long kid = -1;
      for (long i = 0; d + 1 < B && i < T; ++i)
        if (pr[i] == cur && tk[i] == x) {
          kid = i;
          break;
        }
      if (kid < 0) {
        bonus[r] = x;
        break;
      }
      cur = kid;
      p[++d] = cur;
    }
    accepted[r] = d;
  }
}

void tree_graft_lookup(const TreeGraftArgs& a) {
  const long T = a.T, C = a.C;
  for (long r = 0; r < a.R; ++r) {
    const int64_t* seq = a.tokens + r * a.lds;
    const int64_t *tk = a.in_tokens + r * a.ldt, *pr = a.in_parents + r * a.ldp, *dp = a.in_depths + r * a.ldd;
    int64_t *otk = a.out_tokens + r * T, *opr = a.out_parents + r * T, *odp = a.out_depths + r * T;
    for (long i = 0; i < T; ++i) otk[i] = tk[i], opr[i] = pr[i], odp[i] = dp[i];
    const long len = a.lengths[r] < 0 ? 0 : (a.lengths[r] > C ? C : a.lengths[r]);
    long first = -1;  // the continuation's first index in the row
    for (long n = a.max_n; n >= a.min_n && first < 0; --n)
      for (long s = len - n - 1; s >= 0; --s) {
        long j = 0;
        while (j < n && seq[s + j] == seq[len - n + j]) ++j;
        if (j == n) {
          first = s + n;
          break;
        }
      }
    if (first < 0) continue;
    const long k = a.limit < len - first ? a.limit : len - first;
    std::vector<long> chain;  // a_j: the continuation's nodes already in the tree, root to leaf
    long node = 0;
    for (long j = 0; j < k; ++j) {
      long kid = -1;
      for (long i = 1; i < T; ++i)
        if (pr[i] == node && tk[i] == seq[first + j]) {
          kid = i;
          break;
        }
      if (kid < 0) break;
      chain.push_back(node = kid);
    }
    long m = 0;
    for (;; ++m) {
      long d = 0;
      while (d < static_cast<long>(chain.size()) && chain[d] < T - m) ++d;
      if (k - d <= m) break;
    }
    const long d = k - m;
    long parent = d ? chain[d - 1] : 0;
    for (long q = 0; q < m; ++q) {
      const long i = T - m + q;
      otk[i] = seq[first + d + q], opr[i] = parent, odp[i] = d + q + 1;
      parent = i;
    }
  }
}

void tree_compact(const TreeCompactArgs& a) {
  char *kc = a.k_cache, *vc = a.v_cache;
  const int64_t *path = a.path, *accepted = a.accepted, *start = a.start, *rows = a.rows;
  const long ldp = a.ldp, R = a.R, L = a.L, Nb = a.Nb, cap = a.cap, row_bytes = a.row_bytes;
  for (long l = 0; l < L; ++l)
    for (long r = 0; r < R; ++r) {
      const long b = rows[r], base = ((l * Nb + b) * cap + start[r]) * row_bytes;
      for (long d = 1; d <= accepted[r]; ++d) {
        const long src = path[r * ldp + d];
        if (src == d || start[r] + src >= cap) continue;
        memcpy(kc + base + d * row_bytes, kc + base + src * row_bytes, row_bytes);
        memcpy(vc + base + d * row_bytes, vc + base + src * row_bytes, row_bytes);
      }
    }
}

}  // namespace dflash_cpu
