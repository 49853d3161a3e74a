"""target_service/models."""
