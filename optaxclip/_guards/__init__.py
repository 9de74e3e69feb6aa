"""The step guards: skipping whole steps, dynamic loss scaling, micro-batch guards."""
