"""SGLang's weight-loading progress bars only where they measure progress: over several shard files.

A model in one file (every CPU example, a 1.5B model) loads in one step, so its bar only goes from 0 to
1 in every engine start and every restart; ``weight_utils`` draws one per loading path. Several shards
(a 7B or 70B model) keep their bar."""

from sparse_rl_mega.rollout import sglang_internals


class _BarOverShards:
    """``tqdm`` as ``sglang.srt.model_loader.weight_utils`` calls it, disabled for one shard or less."""

    def __new__(cls, iterable=None, *args, total=None, disable=False, **kwargs):
        from tqdm.auto import tqdm

        shards = total if total is not None else len(iterable) if hasattr(iterable, "__len__") else None
        return tqdm(iterable, *args, total=total, disable=disable or (shards is not None and shards <= 1), **kwargs)

    @staticmethod
    def _get_free_pos(*args, **kwargs):
        from tqdm.auto import tqdm

        return tqdm._get_free_pos(*args, **kwargs)


def install() -> None:
    sglang_internals.hook_loading_bar(_BarOverShards)
