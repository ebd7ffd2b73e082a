"""Claim 37, measured: the latency penalty of offloading the KV cache to disk.

kvlab demotes evicted tokens to pinned CPU memory and an offload file and recalls them by page
(:mod:`kvlab.cache.demotion`); ``bench/demotion_gpu.py`` times decoding with each tier against the same eviction
deleting them (what is kept on the GPU alone), on one device and one context read once. The penalty is the disk
tier's decode time per token over the deleting one's; the article's "100x" holds when kvlab's is about that or more.
"""

from __future__ import annotations

from kvlab.claims.commands import demotion_timing
from kvlab.claims.evidence import Demotion, DemotionConfiguration, Evidence
from kvlab.claims.options import demotes_to_disk
from kvlab.claims.verdicts import Evaluation, about, judged, missing, unmeasurable

#: The article's penalty: disk offloading makes a decoded token this many times slower.
CLAIMED_PENALTY = 100.0


def _penalty(result: Demotion) -> tuple[DemotionConfiguration, DemotionConfiguration] | None:
    """The deleting configuration (no cache option set) and the disk tier's, where the timing has both."""
    gpu = [row for row in result.configurations if not row.params]
    disk = [row for row in result.configurations if demotes_to_disk(row.params)]
    return (gpu[0], disk[0]) if gpu and disk else None


def disk_penalty(evidence: Evidence) -> Evaluation:
    """Claim 37: disk-based offloading introduces a 100x latency penalty."""
    timed, problems = evidence.demotions
    command = demotion_timing()
    pairs = [(result, pair) for result in timed if (pair := _penalty(result)) is not None]
    if not pairs:
        if problems:
            return unmeasurable(f"{'; '.join(problems)}; run: {command}", command=command)
        return missing("a disk tier beside deleted evicted tokens", evidence.results_place("demotion"), command)
    parts, facts = [], []
    for result, (gpu, disk) in pairs:
        ratio = disk.decode_ms / gpu.decode_ms
        parts.append((f"on {result.device}", ratio >= CLAIMED_PENALTY or about(ratio, CLAIMED_PENALTY)))
        facts.append(f"{disk.decode_ms:.1f} against {gpu.decode_ms:.1f} ms/token ({ratio:.2f}x)")
    first = pairs[0][0]
    figure = (
        f"decoding with evicted tokens demoted to an offload file and recalled by page, against the same eviction "
        f"deleting them (what is kept on the GPU alone), {first.context_tokens:,} tokens read: " + "; ".join(facts)
    )
    models = ", ".join(dict.fromkeys(result.model for result, _ in pairs))
    devices = ", ".join(dict.fromkeys(result.device for result, _ in pairs))
    return judged(parts, figure, model=models, device=devices, command=command)
