"""meshnode.optim"""
