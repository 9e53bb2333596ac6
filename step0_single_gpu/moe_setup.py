"""A mixture of experts set up from a trainer's flags: the flags, their mistakes refused, GPT-2
wired in, and the two hooks the training loop calls. What steps 0, 10 and 12's train.py call by
name; the idea is moe.py's, which needs no particular model: this file imports it, never the other
way round.

``add_moe_flags`` and ``check_moe``: ``--moe-experts E`` (0: dense), ``--moe-top-k``,
``--moe-every``, ``--moe-capacity-factor``, ``--moe-aux-loss-coef``; a flag that cannot work ends
the run with one line (``UserError``: exit 2). ``moe_model``: an ``MoE`` in place of the MLP of
every ``--moe-every``-th block, its parameters set from (seed, name) as every other's. In the loop:
``with_aux_loss`` (the loss to differentiate) and ``take_moe_record`` (what a step's record says of
the experts' load).
"""

import torch

from failures import UserError
from model import initial_value
from moe import MoE

MOE_DEFAULTS = {
    "moe_top_k": 2,
    "moe_every": 1,
    "moe_capacity_factor": 0.0,
    "moe_aux_loss_coef": 0.01,
}


def add_moe_flags(parser) -> None:
    """The MoE flags, in the steps that train an MoE (0, 10 and 12). Defaults None: given with
    --moe-experts 0 they are refused (a dense model would silently ignore them); ``check_moe`` fills
    in ``MOE_DEFAULTS``."""
    moe = parser.add_argument_group("mixture of experts (common/moe.py)")
    # "%(default).0s" prints nothing: the help says the
    # real default, and argparse adds no "(default: None)".
    moe.add_argument(
        "--moe-experts",
        type=int,
        default=0,
        metavar="E",
        help="experts per MoE layer; 0: dense MLPs",
    )
    moe.add_argument(
        "--moe-top-k",
        type=int,
        default=None,
        metavar="K",
        help=f"experts per token (default {MOE_DEFAULTS['moe_top_k']}; 1 as Switch, 2 as "
        "Mixtral%(default).0s)",
    )
    moe.add_argument(
        "--moe-every",
        type=int,
        default=None,
        metavar="N",
        help="blocks 0, N, 2N, ... are MoE layers (default "
        f"{MOE_DEFAULTS['moe_every']}%(default).0s)",
    )
    moe.add_argument(
        "--moe-capacity-factor",
        type=float,
        default=None,
        metavar="C",
        help="each expert takes at most ceil(k*T*C/E) of a micro-batch's T tokens' slots, "
        "the rest pass "
        "on the residual; 0: dropless (default "
        f"{MOE_DEFAULTS['moe_capacity_factor']:g}%(default).0s)",
    )
    moe.add_argument(
        "--moe-aux-loss-coef",
        type=float,
        default=None,
        metavar="A",
        help="weight of the load-balancing loss (default "
        f"{MOE_DEFAULTS['moe_aux_loss_coef']:g}%(default).0s)",
    )


def check_moe(config: dict) -> None:
    """Refuse MoE flags that mean nothing clear (a UserError:
    one line, exit 2), then fill in the defaults."""
    given = [f"--{k.replace('_', '-')}" for k in MOE_DEFAULTS if config.get(k) is not None]
    experts = config["moe_experts"]
    if experts < 0:
        raise UserError(f"--moe-experts cannot be negative, got {experts}")
    if experts == 0:
        if given:
            raise UserError(
                f"{' '.join(given)} given with --moe-experts 0 (a dense model): set "
                "--moe-experts E to "
                "train a mixture of experts, or drop them"
            )
        return
    for key, value in MOE_DEFAULTS.items():
        if config.get(key) is None:
            config[key] = value
    k, every = config["moe_top_k"], config["moe_every"]
    if not 1 <= k <= experts:
        raise UserError(f"--moe-top-k {k} must be between 1 and --moe-experts {experts}")
    if every < 1:
        raise UserError(f"--moe-every must be at least 1, got {every}")
    for key in ("moe_capacity_factor", "moe_aux_loss_coef"):
        if not config[key] >= 0:
            raise UserError(f"--{key.replace('_', '-')} cannot be negative, got {config[key]:g}")


def moe_blocks(config: dict) -> list[int]:
    """The blocks whose MLP is an MoE layer."""
    every = config.get("moe_every") or 1
    return (
        [i for i in range(config["n_layer"]) if i % every == 0] if config.get("moe_experts") else []
    )


def moe_model(model, config: dict):
    """``model`` (model.py's GPT-2) with an MoE in place of the MLP of each of ``moe_blocks``, every
    new parameter set by ``initial_value`` from (seed, name); unchanged for --moe-experts 0. Built
    on the meta device, as ``build_model`` builds, so that no random draw moves the
    global generator."""
    for i in moe_blocks(config):
        with torch.device("meta"):
            moe = MoE(
                model.config,
                config["moe_experts"],
                config["moe_top_k"],
                config["moe_capacity_factor"],
            )
        moe.to_empty(device="cpu")
        with torch.no_grad():
            for name, param in moe.named_parameters():
                param.copy_(
                    initial_value(
                        f"transformer.h.{i}.mlp.{name}",
                        param.shape,
                        config["seed"],
                        config["n_layer"],
                    )
                )
        model.transformer.h[i].mlp = moe
    return model


def moe_layers(model) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def with_aux_loss(model, loss: torch.Tensor, config: dict) -> torch.Tensor:
    """The loss to differentiate: ``loss`` plus a times each MoE layer's load-balancing loss of this
    forward (its layers in order); ``loss`` itself, the same tensor, for a dense model."""
    layers = moe_layers(model)
    if not layers or not config["moe_aux_loss_coef"]:
        return loss
    aux = layers[0].aux_loss
    for layer in layers[1:]:
        aux = aux + layer.aux_loss
    return loss + config["moe_aux_loss_coef"] * aux


def take_moe_record(model) -> dict:
    """What a step's record holds of the MoE layers since the last call (then cleared): ``{"moe":
    {"aux_loss": the layers' summed load-balancing loss, unscaled, averaged over micro-batches,
    "tokens_per_expert": per layer the slots each expert computed, "dropped_fraction": per
    layer}}``; ``{}`` for a dense model."""
    layers = moe_layers(model)
    if not layers:
        return {}
    record = {
        "aux_loss": sum(m.totals["aux_loss"] / max(1, m.totals["micro_batches"]) for m in layers),
        "tokens_per_expert": [m.totals["tokens_per_expert"].tolist() for m in layers],
        "dropped_fraction": [m.totals["dropped"] / max(1, m.totals["slots"]) for m in layers],
    }
    for m in layers:
        m.totals.update(
            tokens_per_expert=torch.zeros_like(m.totals["tokens_per_expert"]),
            dropped=0,
            slots=0,
            aux_loss=0.0,
            micro_batches=0,
        )
    return {"moe": record}
