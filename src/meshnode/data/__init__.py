"""meshnode.data"""
