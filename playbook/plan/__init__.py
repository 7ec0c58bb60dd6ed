"""The peak memory a run will need, estimated before the model is built, and the options that bring it under
the GPU's memory."""
