"""What a step costs in time and bytes, as formulas: data parallelism (data_parallel.py) and data x
tensor parallelism (tensor_parallel.py). `lbt plan` evaluates them; the trainer counts bytes with them."""
