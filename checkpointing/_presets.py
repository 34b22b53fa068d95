"""Others' policy names: MaxText's ``remat_policy`` values, as what each keeps by tensor name.

Owns the table behind ``checkpointing.policies.maxtext`` and the ``"maxtext:<name>"`` policy
names: for each of MaxText's remat policies, the tensor names it keeps on the device and those it
moves to host memory, and the names MaxText's decoder layers give their tensors
(``jax.ad_checkpoint.checkpoint_name``; ours is ``checkpointing.policies.tag``). It holds the
table and its argument checks only: ``policies`` builds the policies
(``save_only_these_names``, ``offload_these_names``), and ``integrations`` names a
transformers model's tensors with MaxText's names (``_hf_tags``).

NOTE [MaxText presets]
  Rule 1. A preset keeps exactly MaxText's list of names, placed as MaxText places them
          (``Decoder.get_remat_policy`` in MaxText's ``layers/decoders.py``): a name in a
          ``save_only_these_names`` list is kept on the device (our
          ``save_only_these_names``, MUST_SAVE), one in ``names_which_can_be_offloaded`` moves to
          host memory until backward (our ``offload_these_names``, MUST_CPU_OFFLOAD), every other
          op is recomputed. ``"full"`` is MaxText's policy ``None``: recompute everything
          (``save_nothing()``). Names in a list that a model never tags keep nothing, as in
          MaxText (``qkv_proj`` only exists with ``fused_qkv``).
  Rule 2. ``"custom"`` takes MaxText's per-tensor options (``query_proj="offload"``, ...,
          each ``"remat"``, ``"device"`` or ``"offload"``; ``"remat"`` when not given, as in
          MaxText's ``base.yml``) as keyword arguments; no other preset takes any. The table of
          names (``"maxtext:minimal"``) holds the presets without arguments; ``"custom"`` is
          only reached through ``policies.maxtext("custom", ...)``.
  Rule 3. ``decoder_layer_input`` is the checkpointed layer's input: our checkpoint keeps its
          inputs on the device whatever the policy says (a policy decides for ops run inside the
          region), which is MaxText's default ``"device"`` (its ``base.yml``: the layer input
          "cannot be rematerialized"). ``"device"`` is accepted; ``"remat"`` cannot be honoured
          and ``"offload"`` is not provided by a policy (``checkpointing.offload_wrapper`` keeps
          a module's saves, its inputs included, in host memory), so both are errors rather
          than a silent device copy.
  Rule 4. MaxText names ``query_proj`` and ``key_proj`` after the rotary embedding, where the
          tensors enter attention; a Hugging Face layer has no module there, so ``_hf_tags``
          names the outputs of ``q_proj`` and ``k_proj`` (before the rotary embedding, same
          shape and bytes): the rotary embedding, elementwise, is recomputed from them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

__all__ = [
    "CUSTOM",
    "LAYER_INPUT",
    "MAXTEXT_NAMES",
    "MAXTEXT_PRESETS",
    "PLACEMENTS",
    "maxtext_placements",
]

# MaxText's tensor names, as its ``base.yml`` lists them for ``remat_policy: 'custom'``, with
# the tensor each one names in a decoder layer.
MAXTEXT_NAMES: Final[dict[str, str]] = {
    "decoder_layer_input": "the layer's input (the residual stream entering it)",
    "query_proj": "the query projection's output",
    "key_proj": "the key projection's output",
    "value_proj": "the value projection's output",
    "qkv_proj": "the fused query/key/value projection's output (fused_qkv)",
    "context": "attention's output, before the output projection",
    "out_proj": "the attention output projection's output",
    "mlpwi_0": "the MLP's gate projection's output (wi_0)",
    "mlpwi_1": "the MLP's up projection's output (wi_1)",
    "mlpwi": "the MLP's fused gate/up projection's output (fused_mlp, or a one-matrix MLP)",
    "mlpwo": "the MLP's down projection's output (wo)",
    "mla_q": "multi-head latent attention's query (DeepSeek)",
    "mla_kv": "multi-head latent attention's key/value (DeepSeek)",
}
LAYER_INPUT: Final = "decoder_layer_input"
CUSTOM: Final = "custom"
PLACEMENTS: Final = ("remat", "device", "offload")

_QKV: Final = ("query_proj", "value_proj", "key_proj", "qkv_proj")
_MINIMAL: Final = (*_QKV, "out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo")

# Rule 1: per remat policy, (names kept on the device, names offloaded to host), in MaxText's
# order, as ``Decoder.get_remat_policy`` lists them.
MAXTEXT_PRESETS: Final[dict[str, tuple[tuple[str, ...], tuple[str, ...]]]] = {
    "minimal_with_context": ((*_MINIMAL, "context"), ()),
    "minimal": (_MINIMAL, ()),
    "save_dot_with_context_except_mlp": ((*_QKV, "context", "out_proj"), ()),
    "save_dot_except_mlpwi": ((*_QKV, "out_proj", "mlpwo"), ()),
    "save_dot_except_mlp": ((*_QKV, "out_proj"), ()),
    "save_qkv_proj": (_QKV, ()),
    "qkv_proj_offloaded": ((), ("query_proj", "value_proj", "key_proj")),
    "minimal_offloaded": ((), _MINIMAL),
    "save_out_proj": (("out_proj",), ()),
    "full": ((), ()),
}

_API: Final = "checkpointing.policies.maxtext"
_MSG_UNKNOWN_PRESET = (
    _API + ": unknown MaxText remat_policy {got!r}; expected one of {names}. Fix: pass the value "
    "of remat_policy from your MaxText config, e.g. maxtext('minimal'), or maxtext('custom', "
    "query_proj='offload', ...) for per-tensor choices."
)
_MSG_ARGUMENTS_WITHOUT_CUSTOM = (
    _API + ": remat_policy {name!r} takes no per-tensor options, got {given}. Fix: "
    "maxtext({name!r}) alone, or maxtext('custom', {given}) to place tensors one by one."
)
_MSG_UNKNOWN_TENSOR = (
    _API + "('custom', ...): unknown tensor name(s) {got}; expected some of {names} (MaxText's "
    "names, as its base.yml lists them for remat_policy: 'custom'). Fix: spell them as MaxText "
    "does, e.g. query_proj='offload'."
)
_MSG_PLACEMENT = (
    _API + "('custom', ...): {name}={got!r}; expected 'remat', 'device' or 'offload' "
    "(recompute it, keep it on the device, keep it in host memory). Fix: e.g. {name}='device'."
)
_MSG_LAYER_INPUT = (
    _API + "('custom', ...): decoder_layer_input={got!r} cannot be honoured: the layer input is "
    "the checkpointed region's input, which checkpointing keeps on the device whatever the "
    "policy says (MaxText's default 'device'; a policy decides for the ops run inside the "
    "region). Fix: leave decoder_layer_input out (or 'device'); to keep a layer's saves, its "
    "input included, in host memory, wrap the layer with checkpointing.offload_wrapper."
)


def maxtext_placements(
    remat_policy: str, custom: Mapping[str, object]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The tensor names ``remat_policy`` keeps on the device and those it offloads (Rule 1),
    with ``custom``'s per-tensor options for ``"custom"`` (Rules 2 and 3); checked."""
    if remat_policy == CUSTOM:
        return _custom_placements(custom)
    preset = MAXTEXT_PRESETS.get(remat_policy) if isinstance(remat_policy, str) else None
    if preset is None:
        names = ", ".join(map(repr, [*MAXTEXT_PRESETS, CUSTOM]))
        raise ValueError(_MSG_UNKNOWN_PRESET.format(got=remat_policy, names=names))
    if custom:
        given = ", ".join(f"{name}={value!r}" for name, value in custom.items())
        raise TypeError(_MSG_ARGUMENTS_WITHOUT_CUSTOM.format(name=remat_policy, given=given))
    return preset


def _custom_placements(custom: Mapping[str, object]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Rules 2 and 3: MaxText's ``custom`` options, checked, as (device names, host names)."""
    unknown = sorted(custom.keys() - MAXTEXT_NAMES.keys())
    if unknown:
        names = ", ".join(MAXTEXT_NAMES)
        raise TypeError(_MSG_UNKNOWN_TENSOR.format(got=", ".join(unknown), names=names))
    for name, placement in custom.items():
        if not isinstance(placement, str) or placement not in PLACEMENTS:
            raise ValueError(_MSG_PLACEMENT.format(name=name, got=placement))
    layer_input = custom.get(LAYER_INPUT, "device")
    if layer_input != "device":
        raise ValueError(_MSG_LAYER_INPUT.format(got=layer_input))
    ordered = [name for name in MAXTEXT_NAMES if name in custom and name != LAYER_INPUT]
    saved = tuple(name for name in ordered if custom[name] == "device")
    offloaded = tuple(name for name in ordered if custom[name] == "offload")
    return saved, offloaded
