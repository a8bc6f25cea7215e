"""Whether a `hisparse demo` workload can run, decided before the model, the prompts or any store is made.

`check_workload` refuses (DemoSetupError, naming the option to change) a workload past the model's positions or the
held-out text, a store its own checks refuse (`CacheConfig`, the hot rows one step can miss, the kernels' pairing),
a policy budget of no page, and one whose memory account (`workload_costs`: stores, step temporaries, the model's
copies) does not fit this machine (`check_memory` bisects the largest value of the culprit option that would).
"""

from __future__ import annotations

import argparse

import jax

from hisparse_jax.config import ModelConfig
from hisparse_jax.demo_workload import DemoSetupError, option_budgets, policy_budgets
from hisparse_jax.engine import EngineConfig
from hisparse_jax.engine.scheduler import policy_cache
from hisparse_jax.engine.speculative import lookahead
from hisparse_jax.kv.account import store_costs
from hisparse_jax.kv.spec import StoreSpec
from hisparse_jax.kv.tiered import check_backend
from hisparse_jax.memory import Cost, check_account
from hisparse_jax.train import data as text_data


def check_workload(args: argparse.Namespace, cfg: ModelConfig, kind: str, longest: int) -> None:
    """DemoSetupError, before anything is allocated, for a workload that cannot run: text prompts for a model
    whose vocabulary is not bytes; more devices than jax sees; the prompt (`longest` tokens) and the new tokens
    (plus the speculative lookahead) past the model's max_position_embeddings; text prompts past the held-out text,
    one distinct start each; a store the options give that its own checks refuse; a policy's device budget of no
    page; the host pools (every request's pages, on each device) and the device budgets past the machine's
    memory (`check_memory`)."""
    if kind == "text" and cfg.vocab_size != text_data.VOCAB_SIZE:
        raise DemoSetupError(f"--workload text: the prompts are bytes (256 token ids); this model's vocabulary has "
                             f"{cfg.vocab_size} (use --workload random)")
    n_dev, new, extra = args.devices, args.new_tokens, lookahead(args.speculative_tokens)
    if args.index_summary == "rvq" and n_dev > 1:
        raise DemoSetupError(f"--index-summary rvq runs on one device (--devices {n_dev}): a MeshEngine's stores are "
                             "not given codebooks yet")
    if n_dev > len(jax.devices()):
        raise DemoSetupError(f"--devices {n_dev}: jax sees {len(jax.devices())} device(s) "
                             f"({jax.default_backend()}); on a CPU start the process with "
                             f"XLA_FLAGS=--xla_force_host_platform_device_count={n_dev} (the hisparse command sets it "
                             "when jax has not started yet)")
    positions = cfg.max_position_embeddings
    prompt_opt = f"--prompt-len {longest}" if args.prompt_len else f"the default prompt length ({longest} tokens)"
    if longest + 1 + extra > positions:
        raise DemoSetupError(f"{prompt_opt} must be <= {positions - 1 - extra}: a prompt and one new token"
                             f"{' (and the speculative lookahead)' if extra else ''} must fit the model's "
                             f"max_position_embeddings ({positions})")
    if longest + new + extra > positions:
        raise DemoSetupError(f"--new-tokens {new} must be <= {positions - longest - extra}: the longest prompt "
                             f"({longest} tokens) and its new tokens must fit the model's max_position_embeddings "
                             f"({positions})")
    text = text_data.load_corpus()[1].size if kind == "text" else None
    if text is not None and longest > text:
        raise DemoSetupError(f"{prompt_opt} must be <= {text}: the held-out text has {text} tokens")
    max_len = longest + new + extra
    try:  # the store's own checks: CacheConfig's, the hot rows one step can miss, the kernels' pairing
        base, _ = option_budgets(args, cfg, max_len)
        check_backend(StoreSpec.create(cfg, base), args.kernels)
    except ValueError as e:
        raise DemoSetupError(str(e)) from None
    policy_budgets(args, cfg, max_len)  # a budget of no pages at all: refused now, not after the model is made
    check_memory(args, cfg, longest)
    room = None if text is None else text - longest + 1  # distinct prompt starts (`text_data.document_prompts`)
    if room is not None and args.requests * n_dev > room:
        raise DemoSetupError(f"--requests {args.requests} must be <= {room // n_dev}: the held-out text ({text} "
                             f"tokens) holds {room} distinct prompts of {longest} tokens"
                             + (f" ({n_dev} devices x --requests are asked for)" if n_dev > 1 else ""))


def workload_costs(args: argparse.Namespace, cfg: ModelConfig, longest: int) -> list[Cost]:
    """The memory account of the workload `args` asks for (`kv.account.store_costs`), per device: the largest store
    an engine of its policies builds (`demo_run.run_policies`' budgets: --device-requests split per policy, every
    policy inside one capacity, host pools for every request's pages (--requests), hot buffers of --hot-rows rows), the
    temporaries of the engine's largest step, and a copy of the model's parameters. Raises DemoSetupError when a
    policy's budget holds no page (`policy_budgets`)."""
    k = args.speculative_tokens
    capacity = policy_budgets(args, cfg, longest + args.new_tokens + lookahead(k)).capacity
    stores = [StoreSpec.create(cfg, policy_cache(capacity, pol, args.requests, k, args.admission))
              for pol in args.policies]
    step = EngineConfig(max_running=args.requests, prefill=args.prefill, prefill_chunk=args.prefill_chunk,
                        speculative_tokens=k, prefix_caching=not k)
    model = Cost("the model's parameters", sum(cfg.parameter_bytes(mtp=bool(k)).values()), "device",
                 f"--devices {args.devices} (one copy each)")
    cpu = jax.default_backend() == "cpu"  # XLA:CPU's step copies the store (`kv.account.store_costs`)
    costs = [store_costs(spec, step_rows=step.max_step_rows, index_heads=cfg.index_n_heads, cpu=cpu) + [model]
             for spec in stores]
    return max(costs, key=lambda c: sum(x.nbytes for x in c))


def culprit(args: argparse.Namespace, part: str) -> str:
    """The option a part of the account follows (`workload_costs`): the one whose bound a refusal states."""
    if "hot" in part and args.hot_rows:
        return "--hot-rows"
    if "step rows" in part and args.prefill == "chunked" and args.prefill_chunk > args.requests:
        return "--prefill-chunk"
    if any(f"store's {n}" in part for n in ("latent", "rope", "index_")) or "sized by device_pages=" in part:
        return "--device-requests"
    if "parameters" in part and args.devices > 1:
        return "--devices"
    return "--requests"


def check_memory(args: argparse.Namespace, cfg: ModelConfig, longest: int) -> None:
    """DemoSetupError, before anything is allocated, when the workload's memory account (`workload_costs`: the store
    of every device, their host pools, the step's temporaries, the model's copies) does not fit this machine's
    memory (`memory.check_account`, as the engine checks it): the message gives the largest value of the option
    behind the largest part that would fit, with the others as given."""
    def refusal(**change) -> str | None:
        a = argparse.Namespace(**{**vars(args), **change})
        try:
            costs = workload_costs(a, cfg, longest)
        except ValueError:  # a budget of no pages (`check_workload` refuses it): none of its memory is taken
            return None
        try:
            check_account("the workload", costs, ranks=a.devices)
        except ValueError as e:
            return str(e)
        return None

    def largest(option: str):  # the largest value of `option` that fits, the others as given (None: none)
        field = option[2:].replace("-", "_")
        if option == "--device-requests":  # a float: bisect to 4 significant digits
            lo, hi = 0.0, float(args.device_requests)
            while hi - lo > 1e-4 * hi:
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if refusal(device_requests=mid) is None else (lo, mid)
            return float(f"{lo:.4g}") or None
        least = (args.speculative_tokens + 1) * cfg.index_topk if field == "hot_rows" else 1
        lo, hi = least - 1, getattr(args, field)  # hi is refused; lo: none fits
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if refusal(**{field: mid}) is None else (lo, mid)
        return lo if lo >= least else None

    why = refusal()
    if why is None:
        return
    if args.devices > 1 and refusal(devices=1) is None:  # one device's share fits: the devices' count does not
        option = "--devices"
    else:
        option = culprit(args, why.split("the largest part is ", 1)[1])
    bound = largest(option)
    if bound is None and args.devices > 1:  # not even the least of it fits next to the other devices' shares
        option, bound = "--devices", largest("--devices")
    value = getattr(args, option[2:].replace("-", "_"))
    shown = (f"{value:g}", f"{bound or 0:g}") if isinstance(value, float) else (value, bound or 0)
    raise DemoSetupError(f"{option} {shown[0]} must be <= {shown[1]} on this machine: {why}")
