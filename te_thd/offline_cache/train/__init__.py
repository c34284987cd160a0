"""What a training loop calls: samplers, collates and the data loader."""
