"""What each rank does with the implementation's quantized weight in each scenario."""
