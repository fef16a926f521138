"""Recovery: checkpoints restored from their owners, the survivors' state after a failure, join
requests, and the forgery harness that plays a hostile worker against them."""
