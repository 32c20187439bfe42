"""The vLLM engine's face, one story on the default model, run by ``test_vllm_engine.py``
with ``.venv-vllm/bin/python`` (vLLM is not in the test's virtualenv): prints one JSON
line of what it saw.

Export a prompt's blocks, copy them (as a pull would) into blocks taken for an import,
release the export, decode from the import: the greedy tokens of a plain run. Then leave
imported requests early and release twice: the pool ends where it began. Abort an export
mid-prefill: its blocks go back. Release two exports, the first finished before the
second (whose step saw the first one's finish), the second first, with no traffic after:
every block goes back and the engine thread goes idle. All of it on a core-lending board
whose other engine is idle (so the steps run on every core), then the lending itself.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import shutil
import sys
import tempfile
from pathlib import Path

from kvmesh.engine.core_lending import CoreLending


async def story(model: str) -> dict:
    import torch

    from kvmesh.engine.request import SamplingParams
    from kvmesh.worker.engines import create_engine
    from kvmesh.settings.worker import EngineSettings

    board = Path(tempfile.mkdtemp()) / "cores"  # slot 0 this engine's, slot 1 another's (idle but in lending())
    CoreLending.create(board, 2)
    settings = EngineSettings(
        name="vllm", model=model, block_size=32, kv_cache_bytes=128 * 2**20, num_threads=1, lend_cores=f"{board}:0"
    )
    engine = await create_engine(settings)
    seen: dict = {"free_at_start": (await engine.pool_stats()).num_free}
    try:
        prompt = [504, 3575, 282, 4649, 314] * 14  # 70 tokens: two full blocks and a part
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        seen["plain"] = [t async for out in engine.generate("plain", prompt, params) for t in out.new_token_ids]
        reset = engine.core.engine.reset_prefix_cache  # so that the import below is one
        await engine._call(reset)
        out = await engine.prefill_export("x", prompt, params)
        assert out.kv_export is not None
        seen["export"] = {"first": out.new_token_ids, "blocks": len(out.kv_export.block_ids), "tokens": out.kv_export.num_tokens}
        staged = await engine.allocate_import("y", len(prompt))
        assert staged is not None
        src, dst = torch.tensor(list(out.kv_export.block_ids)), torch.tensor(staged)

        def pull() -> None:
            for cache in engine.core.kv_caches:
                cache[dst] = cache[src]

        await engine._call(pull)
        seen["released"] = [await engine.release_export("x"), await engine.release_export("x")]
        await engine._call(reset)
        stream = engine.generate_from_import("y", prompt, out.new_token_ids[0], "y", params)
        seen["imported"] = [t async for o in stream for t in o.new_token_ids]
        seen["blocks_copied"] = engine.core.blocks_copied  # of the import's three
        for i in range(3):  # leave after one, two, three outputs
            await engine.allocate_import(f"h{i}", len(prompt))
            stream = engine.generate_from_import(f"r{i}", prompt, 504, f"h{i}", SamplingParams(max_tokens=50, ignore_eos=True))
            n = 0
            async for _ in stream:
                n += 1
                if n == i + 1:
                    break
            await stream.aclose()
        seen["release_unused"] = [await engine.allocate_import("z", 40) is not None, await engine.release_import("z"), await engine.release_import("z")]
        await settle(engine)
        await engine._call(reset)
        seen["fully_cached_import"] = await fully_cached_import(engine)
        seen["lend_and_borrow"] = await lend_and_borrow(engine, seen["plain"])
        seen["borrow_after_own_prefix"] = await borrow_after_own_prefix(engine)
        await engine._call(reset)
        seen["abort_mid_prefill"] = await abort_mid_prefill(engine)
        seen["release_idle"] = await release_on_an_idle_engine(engine)
        seen["guided"] = await guided_hand_off(engine)
        seen["lending"] = await lending(engine, board)
        for _ in range(50):
            stats = await engine.pool_stats()
            if stats.num_in_use == 0:
                break
            await asyncio.sleep(0.1)
        seen["free_at_end"] = stats.num_free
        seen["in_use_at_end"] = stats.num_in_use
    finally:
        await engine.shutdown()
        shutil.rmtree(board.parent, ignore_errors=True)
    return seen


async def lending(engine, board: Path) -> dict:
    """Cores lent (``--lend-cores``): with the other engine on the board idle, the steps so far
    borrowed every core; while it is busy the steps keep to this engine's one thread; its
    turning busy and idle between outputs changes the threads only between steps (vLLM's CPU
    attention fixes a step's thread count in the step's metadata), and no step fails. The
    greedy tokens are the same whichever threads the steps ran on."""
    import torch

    from kvmesh.engine.core_lending import IDLE, OWN
    from kvmesh.engine.request import SamplingParams

    seen: dict = {"borrowed_so_far": engine.lending_counts().borrowed > 0}
    with open(board, "r+b") as f:
        other = mmap.mmap(f.fileno(), 0)
    prompt = [504, 3575, 282, 4649, 314] * 8
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    flipping: list[int] = []
    async for out in engine.generate("lend-flip", prompt, params):  # the other engine busy every other output
        flipping.extend(out.new_token_ids)
        other[1] = OWN if len(flipping) % 2 else IDLE
    other[1] = OWN  # busy for good: this engine keeps to its one thread
    own = [t async for out in engine.generate("lend-own", prompt, params) for t in out.new_token_ids]
    seen["threads_while_other_busy"] = await engine._call(torch.get_num_threads)
    other[1] = IDLE
    borrowing = [t async for out in engine.generate("lend-all", prompt, params) for t in out.new_token_ids]
    seen["threads_while_other_idle"] = await engine._call(torch.get_num_threads)
    seen["same_tokens"] = flipping == own == borrowing and len(own) == 40
    other.close()
    return seen


async def guided_hand_off(engine) -> dict:
    """Structured output across an export and an import: the import has vLLM output the
    export's first token again, forced, under its grammar, and gives the plain run's tokens;
    so does a resumed request (its earlier tokens forced); a first token the grammar does not
    allow fails the import by name. Logprobs come with every token but the import's first
    (the export's). The pool ends where it began."""
    import torch

    from kvmesh.engine.request import SamplingParams
    from kvmesh.engine.structured import GuidedDecoding

    core = engine.core
    before = await settle(engine)
    prompt = [504, 3575, 282, 4649, 314] * 9  # 45 tokens: a whole block and a part
    params = SamplingParams(max_tokens=12, guided=GuidedDecoding("regex", r"[a-z]{3}-[0-9]{4}"), logprobs=2)
    outs = [out async for out in engine.generate("g-plain", prompt, params)]
    plain = [t for out in outs for t in out.new_token_ids]
    seen: dict = {"text": core.tokenizer.decode(plain, skip_special_tokens=True)}
    seen["logprobs"] = [len(out.logprobs or []) == len(out.new_token_ids) for out in outs] == [True] * len(outs)
    export = await engine.prefill_export("g-x", prompt, params)
    assert export.kv_export is not None
    staged = await engine.allocate_import("g-y", len(prompt))
    assert staged is not None
    src, dst = torch.tensor(list(export.kv_export.block_ids)), torch.tensor(staged)
    await engine._call(lambda: [cache.__setitem__(dst, cache[src]) for cache in core.kv_caches])
    await engine.release_export("g-x")
    await engine._call(core.engine.reset_prefix_cache)
    outs = [out async for out in engine.generate_from_import("g-y", prompt, export.new_token_ids[0], "g-y", params)]
    seen["imported"] = [t for out in outs for t in out.new_token_ids] == plain
    seen["import_logprobs"] = [outs[0].logprobs, all(out.logprobs and None not in out.logprobs for out in outs[1:])]
    resumed = SamplingParams(max_tokens=12 - 3, guided=params.guided, prior_output_tokens=3)
    seen["resumed"] = [t async for out in engine.generate("g-r", prompt + plain[:3], resumed) for t in out.new_token_ids] == plain[3:]
    digit = core.tokenizer.encode("7", add_special_tokens=False)[0]  # [a-z] first: not allowed
    await engine.allocate_import("g-bad", len(prompt))
    outs = [out async for out in engine.generate_from_import("g-bad", prompt, digit, "g-bad", params)]
    last = outs[-1]
    seen["refused"] = {"reason": last.finish_reason.value if last.finish_reason else None, "code": last.error_code.value if last.error_code else None, "tokens": [t for o in outs for t in o.new_token_ids]}
    seen["digit"] = digit
    seen["free_back"] = await settle(engine) == before
    return seen


async def settle(engine) -> int:
    """Free blocks once nothing is in use (or after 5 s)."""
    for _ in range(50):
        stats = await engine.pool_stats()
        if stats.num_in_use == 0:
            break
        await asyncio.sleep(0.1)
    return stats.num_free


async def fully_cached_import(engine) -> dict:
    """An import whose every prompt block vLLM has cached itself (a prompt of whole blocks,
    run before): vLLM claims nothing from the connector, and the blocks taken for the pull
    go back when the request ends (they stayed taken for good before)."""
    from kvmesh.engine.request import SamplingParams

    prompt = [71, 1337, 902, 5, 3840, 12, 44, 9] * 8  # 64 tokens: two whole blocks
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    plain = [t async for out in engine.generate("fc-plain", prompt, params) for t in out.new_token_ids]
    before = await settle(engine)
    await engine.allocate_import("fc", len(prompt))
    stream = engine.generate_from_import("fc-import", prompt, plain[0], "fc", params)
    imported = [t async for out in stream for t in out.new_token_ids]
    return {"same_tokens": imported == plain, "free_back": await settle(engine) == before}


async def lend_and_borrow(engine, plain: list[int]) -> dict:
    """A prompt's cached blocks lent (a reference in vLLM's pool: neither evicted nor
    overwritten while lent), copied as a peer's pull would into blocks taken for a borrow,
    released; the lent blocks evicted from vLLM's cache; the borrowed blocks named as the prompt's prefix: the
    prefill takes them through the connector and samples a plain run's first token, vLLM
    caches them, and a plain run then hits them. A borrow no prefill takes is given back."""
    import torch

    from kvmesh.engine.request import SamplingParams

    core = engine.core
    prompt = [504, 3575, 282, 4649, 314] * 14  # the story's prompt: cached by its plain run
    hashes = engine.block_hashes(prompt)  # two whole blocks
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    await engine._call(core.engine.reset_prefix_cache)
    assert [t async for out in engine.generate("lb-plain", prompt, params) for t in out.new_token_ids] == plain
    baseline = await settle(engine)
    seen: dict = {"cached": await engine.cached_prefix_length(hashes)}
    lent = await engine.lend_cached_blocks("loan", hashes)
    stats = await engine.pool_stats()
    seen["lent"] = {"blocks": len(lent), "in_use": stats.num_in_use, "held": stats.num_held}
    snapshot = await engine._call(lambda: [cache[lent].clone() for cache in core.kv_caches])
    # while lent: vLLM may not drop its prefix cache, and other work leaves the blocks as they are
    seen["reset_refused"] = not await engine._call(core.engine.reset_prefix_cache)
    other = [9, 8, 7, 6, 5, 4, 3] * 30
    [t async for out in engine.generate("lb-other", other, SamplingParams(max_tokens=8, ignore_eos=True)) for t in out.new_token_ids]
    seen["unchanged"] = await engine._call(lambda: all(torch.equal(cache[lent], old) for cache, old in zip(core.kv_caches, snapshot)))
    staged = await engine.allocate_import("borrow-b", 2 * 32)
    assert staged is not None

    def pull() -> None:
        src, dst = torch.tensor(lent), torch.tensor(staged)
        for cache in core.kv_caches:
            cache[dst] = cache[src]

    await engine._call(pull)
    seen["released"] = [await engine.release_export("loan"), await engine.release_export("loan")]
    await engine._call(lambda: core.block_pool.evict_blocks(set(lent)))  # vLLM has the prompt no more
    seen["cached_after_eviction"] = await engine.cached_prefix_length(hashes)
    await engine.cache_imported_blocks("borrow-b", hashes, None)
    copied = core.blocks_copied
    out = await engine.prefill_export("lb-prefill", prompt, params)
    seen["borrowed_prefill"] = {
        "first": out.new_token_ids == plain[:1], "cached_tokens": out.num_cached_tokens, "copied": core.blocks_copied - copied,
    }  # fmt: skip
    await engine.release_export("lb-prefill")
    seen["taken"] = not await engine.release_import("borrow-b")
    again = [o async for o in engine.generate("lb-again", prompt, params)]
    seen["again"] = {"same": [t for o in again for t in o.new_token_ids] == plain, "cached_tokens": again[-1].num_cached_tokens}
    unused = await engine.allocate_import("borrow-u", 2 * 32)
    await engine.cache_imported_blocks("borrow-u", hashes, None)
    seen["unused_given_back"] = unused is not None and await engine.release_import("borrow-u")
    seen["free_back"] = await settle(engine) == baseline
    return seen


async def borrow_after_own_prefix(engine) -> dict:
    """vLLM holds a prompt's first block itself and borrows the next two from a peer (here:
    its own, lent, pulled into blocks taken for the borrow, then evicted): the prefill uses
    them where the pull put them, after its own block, copies none, and samples a plain
    run's first token; the blocks go back when it ends."""
    import torch

    from kvmesh.engine.request import SamplingParams

    core = engine.core
    prompt = [504, 3575, 282, 4649, 314, 11] * 17  # 102 tokens: three whole blocks of 32 and a part
    hashes = engine.block_hashes(prompt)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    await engine._call(core.engine.reset_prefix_cache)
    plain = [t async for out in engine.generate("bo-plain", prompt, params) for t in out.new_token_ids]
    baseline = await settle(engine)
    lent = await engine.lend_cached_blocks("bo-loan", hashes[1:])
    staged = await engine.allocate_import("bo", 2 * 32)
    assert len(lent) == 2 and staged is not None

    def pull() -> None:
        src, dst = torch.tensor(lent), torch.tensor(staged)
        for cache in core.kv_caches:
            cache[dst] = cache[src]

    await engine._call(pull)
    await engine.release_export("bo-loan")
    await engine._call(lambda: core.block_pool.evict_blocks(set(lent)))  # vLLM keeps the first block only
    own = await engine.cached_prefix_length(hashes)
    await engine.cache_imported_blocks("bo", hashes[1:], hashes[0])
    copied = core.blocks_copied
    out = await engine.prefill_export("bo-prefill", prompt, params)
    await engine.release_export("bo-prefill")
    return {
        "own_blocks": own, "first": out.new_token_ids == plain[:1], "cached_tokens": out.num_cached_tokens,
        "copied": core.blocks_copied - copied, "taken": not await engine.release_import("bo"),
        "free_back": await settle(engine) == baseline,
    }  # fmt: skip


def small_steps(engine, tokens: int):
    """vLLM's per-step token budget, for a while: prompts prefilled over several steps."""
    import contextlib

    @contextlib.contextmanager
    def budget():
        scheduler = engine.core.scheduler
        old, scheduler.max_num_scheduled_tokens = scheduler.max_num_scheduled_tokens, tokens
        try:
            yield
        finally:
            scheduler.max_num_scheduled_tokens = old

    return budget()


def leftovers(engine) -> dict:
    exchange = engine.core.exchange
    return {
        "exports": len(exchange.exports), "to_release": len(exchange.to_release),
        "vllm_requests": len(engine.core.scheduler.requests),
    }  # fmt: skip


async def abort_mid_prefill(engine) -> dict:
    """An export aborted after vLLM prefilled part of its prompt (a cancel)."""
    from kvmesh.engine.request import SamplingParams

    before = (await engine.pool_stats()).num_free
    core = engine.core

    def prefill_part_then_abort() -> dict:
        with small_steps(engine, 32):
            core.add_request("ab", [17, 4649, 282, 3575, 921] * 14, SamplingParams(max_tokens=4), export_kv=True)
            core.step()
            (request,) = core.scheduler.requests.values()  # vLLM's id is ours plus a suffix
            computed = request.num_computed_tokens
            out = core.abort_request("ab")
        return {"computed": computed, "reason": out.finish_reason.value if out else None}

    seen = await engine._call(prefill_part_then_abort)
    seen["free_back"] = await settle(engine) == before
    seen["leftovers"] = await engine._call(lambda: leftovers(engine))
    return seen


async def release_on_an_idle_engine(engine) -> dict:
    """Exports A and B: A finishes, a step of B's prefill sees A's finish, B finishes and is
    released, then A is released with no other request: both free their blocks, and the
    engine thread stops stepping."""
    from kvmesh.engine.request import SamplingParams

    before = (await engine.pool_stats()).num_free
    core = engine.core
    steps = [0]
    step = core.step

    def counted() -> list:
        steps[0] += 1
        return step()

    core.step = counted  # what the engine thread calls

    def a_then_b() -> list:
        finished = []
        with small_steps(engine, 32):
            core.add_request("A", [33, 700, 1200, 45] * 5, SamplingParams(max_tokens=1), export_kv=True)
            core.add_request("B", [99, 812, 16, 2048, 7] * 14, SamplingParams(max_tokens=1), export_kv=True)
            for _ in range(10):
                finished += [o.request_id for o in step() if o.finished and o.kv_export is not None]
                if len(finished) == 2:
                    break
        return finished

    try:
        seen: dict = {"finished": await engine._call(a_then_b)}
        seen["released"] = [await engine.release_export("B")]
        await asyncio.sleep(0.5)  # B's release is done before A's comes
        seen["released"].append(await engine.release_export("A"))
        seen["free_back"] = await settle(engine) == before
        await asyncio.sleep(0.3)
        at = steps[0]
        await asyncio.sleep(1.0)
        seen["steps_while_idle"] = steps[0] - at
        seen["leftovers"] = await engine._call(lambda: leftovers(engine))

        def release_gone() -> None:  # a release of a request vLLM no longer holds
            with core.exchange.lock:
                core.exchange.to_release.add("gone")

        await engine._call(release_gone)
        await asyncio.sleep(0.5)
        at = steps[0]
        await asyncio.sleep(1.0)
        seen["steps_after_a_gone_release"] = steps[0] - at
    finally:
        core.step = step
    return seen


if __name__ == "__main__":
    sys.stdout.write("\n" + json.dumps(asyncio.run(story(sys.argv[1]))) + "\n")
