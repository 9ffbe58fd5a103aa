"""Neural modules of the Sheaf-State LM: Phi (ssm), G (sheaf), E (experts)."""
