"""meshnode.model"""
