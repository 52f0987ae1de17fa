"""The deep checks the validate stage runs beyond its read pass (`deep = true`): torch's own
load in a child process (`deepscan`) and the scan of safetensors for non-finite values
(`nonfinite`). Never imports another stage or the store."""
