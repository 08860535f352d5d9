"""The n-gram proposer (prompt lookup): a request's drafts are what followed the last occurrence, in
its prompt and output so far, of the n tokens it ends with (the longest n from max_n down to min_n
that occurred before). No model: a copy of the request's own text.

Each request keeps an index from every n-gram it holds to where that n-gram last ended, updated as
tokens arrive, so a proposal is a dictionary lookup per n, not a scan of the context (a decode step
proposes for every running request; contexts run to thousands of tokens).
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.common.scheduling.proposer import Proposer


class NgramIndex:
    """One request's tokens and, for each n, the latest end position of every n-gram but its suffix."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # n -> n-gram -> its end (exclusive) at its latest occurrence, the suffix's own excluded
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending here stop being the suffix once `token` follows
            for n, ends in self.ends.items():
                if end >= n:
                    ends[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens: what followed the latest earlier occurrence of the longest suffix that
        has one; [] when none has."""
        length = len(self.tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = self.ends[n].get(tuple(self.tokens[length - n :]))
            if end is not None:
                return self.tokens[end : min(end + k, length)]
        return []

    def propose_after(self, extra: list[int], m: int) -> list[int]:
        """`propose(m)` as if `extra` had been appended, the index unchanged: the n-grams that end inside
        `extra` (or at its start: the index's own suffix) are looked at first, latest first, then the index.
        With no `extra` it is `propose(m)`."""
        tokens, known = self.tokens, len(self.tokens)
        length = known + len(extra)

        def at(i: int) -> int:
            return tokens[i] if i < known else extra[i - known]

        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            suffix = tuple(at(i) for i in range(length - n, length))
            end = None
            if extra:
                for e in range(length - 1, max(known, n) - 1, -1):  # ends inside extra, latest first
                    if tuple(at(i) for i in range(e - n, e)) == suffix:
                        end = e
                        break
            if end is None:
                end = self.ends[n].get(suffix)
            if end is not None:
                return [at(i) for i in range(end, min(end + m, length))]
        return []


class NgramProposer(Proposer):
    """Drafts for many requests, by request id: `extend` as tokens arrive, `propose` before each
    verify step, `free` when the request ends."""

    hypothesizes = True

    def __init__(self, num_tokens: int, min_n: int = 1, max_n: int = 4):
        if num_tokens < 1:
            raise ValueError(f"--num-speculative-tokens must be >= 1, got {num_tokens}")
        self.num_tokens, self.min_n, self.max_n = num_tokens, min_n, max_n
        self.indexes: dict[str, NgramIndex] = {}
        self.owners: dict[str, object] = {}  # rid -> the Req its index is of (propose_for)

    def extend(self, rid: str, tokens: Iterable[int]) -> None:
        index = self.indexes.get(rid)
        if index is None:
            index = self.indexes[rid] = NgramIndex(self.min_n, self.max_n)
        index.extend(tokens)

    def propose(self, rid: str, limit: int | None = None) -> list[int]:
        """Drafts for `rid`: at most num_tokens, and at most `limit` (the tokens it may still generate)."""
        k = self.num_tokens if limit is None else min(self.num_tokens, limit)
        index = self.indexes.get(rid)
        return index.propose(k) if index is not None and k > 0 else []

    def free(self, rid: str) -> None:
        self.indexes.pop(rid, None)
        self.owners.pop(rid, None)

    def propose_for(self, req, limit: int) -> list[int]:
        """Drafts for a running request (a Req with no pending tokens), at most `limit`. Its index first
        catches up with the tokens the request gained since the last call, however they came (verify
        steps, a prefill's first token, a KV transfer's): O(new tokens), never a rebuild. A request's
        tokens only grow (a retracted one keeps its output), so the index stays a prefix of them."""
        rid = req.rid
        if self.owners.get(rid) is not req:  # a new request, or a rid used again by another
            self.free(rid)
            self.owners[rid] = req
        index = self.indexes.get(rid)
        known, prompt = (len(index.tokens) if index is not None else 0), req.prompt_ids
        if known < len(prompt):
            self.extend(rid, prompt[known:])
            known = len(prompt)
        self.extend(rid, req.output_ids[known - len(prompt) :])
        return self.propose(rid, limit)

    def propose_after(self, req, extra: list[int], limit: int) -> list[int]:
        """At most `limit` tokens continuing `req`'s known tokens followed by `extra` (a verify step still
        in flight: its drafts, as if all were accepted); the first is a guess of the token that step
        samples after them. `limit` may exceed num_tokens by one (that guess)."""
        self.propose_for(req, 0)  # (the index catches up with the request's known tokens)
        index = self.indexes.get(req.rid)
        m = min(self.num_tokens + 1, limit)
        return index.propose_after(list(extra), m) if index is not None and m > 0 else []

    def release(self, req) -> None:
        if self.owners.get(req.rid) is req:
            self.free(req.rid)

    def retain(self, reqs) -> None:
        """Forget every request but `reqs` (those of this step: the others ended, or will be re-indexed)."""
        live = {req.rid for req in reqs}
        for rid in [rid for rid in self.indexes if rid not in live]:
            self.free(rid)
