"""The omni data pipeline: samples, processors, tokenizer, packing, batching, stateful loading.

Entry points (TorchTitan's ``build_tokenizer_fn`` / ``build_dataloader_fn``):
``torchtitan_omni.data.tokenizer.build_omni_tokenizer`` and
``torchtitan_omni.data.loader.build_omni_dataloader``. Special-token names for generation code:
``torchtitan_omni.data.special_tokens``; prompts: ``torchtitan_omni.data.template``. See
docs/data.md.
"""
