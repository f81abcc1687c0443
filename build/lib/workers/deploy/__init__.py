"""What a GPU host does for a deployment: plan (rows into launch specs),
lifecycle (launch, apply a generation, stop), reconcile (make the database and
what runs agree, each beat), telemetry (ship server logs and metrics)."""
