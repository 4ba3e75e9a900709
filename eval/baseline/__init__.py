"""The baselines MFS is compared with: separate deployments of the family's members (built from the core's public
scheduler and policy objects), and how they split the KV memory."""
