"""The model: presets and the training dtype, real pretrained weights offline, loading and preparing a model
for training, the registry of optimizations a user can switch on, LoRA, attention inside each packed example,
greedy decoding."""
