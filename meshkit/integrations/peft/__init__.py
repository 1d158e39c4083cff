"""PEFT LoRA models under every plan (`meshkit.parallelize(get_peft_model(model, LoraConfig(...)), plan)`).

- `layers`: what a PEFT LoRA layer is made of (base layer, A, B, scaling), read by duck typing so
  that `import meshkit` never imports peft;
- `model`: a `PeftModel` as meshkit sees it (its one LoRA adapter, the checks a plan must pass,
  PEFT's initialisation of the adapter);
- `export`: adapters in and out in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`),
  and the merged (`merge_and_unload`) full HF model.

The tensor-parallel layout of an adapter, which follows its base layer, is tensor-parallel knowledge
and lives in `meshkit.tensor_parallel.lora`.
"""
