"""target_service."""
