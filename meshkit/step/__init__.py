"""What one training step needs beyond the model: batch preparation and input checks (`batch`), loss
semantics (`loss`), the all-or-none failure protocol (`consensus`), the gradient sums meshkit issues
itself (`grad_sync`) and the global gradient norm (`grad_norm`). `ParallelModel` composes them."""
